//! Objects decoded without `metadata.managedFields`, for watches whose caches drop them anyway.
//!
//! Managed fields are the largest part of a small object's JSON, and decoding them is
//! allocation-heavy (every `fieldsV1` node becomes a map of its own): in a fleet controller
//! reconciling 5,000 ConfigMaps, decoding the managed fields took 18 % of the process's
//! instructions, only for the cache's transform to drop them (BENCHMARKS.md). [`Trimmed`]
//! decodes an object as `K` does, except that the value of the `managedFields` key of its
//! `metadata` is skipped in the JSON (parsed, not built). Nothing else changes: the
//! transform still runs (for the last-applied annotation and the user's own), and a manager
//! that keeps managed fields decodes objects whole.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube_runtime::watcher::Event;

use super::map_event::map_event;
use serde::de::value::StrDeserializer;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

/// `K`, decoded without its managed fields. Requests for it are requests for `K`.
#[derive(Clone, Debug)]
pub(crate) struct Trimmed<K>(pub(crate) K);

/// `K`, decoded as it is. Like [`Trimmed`], it can be watched in one namespace whatever
/// `K`'s scope type says (kube builds a namespaced `Api` only for scopes known to be
/// namespaced; the crate knows at run time).
#[derive(Clone, Debug)]
pub(crate) struct Whole<K>(pub(crate) K);

/// A decoder's object, held in an [`Arc`] from the moment it is decoded: the watcher's
/// layers and the cache move a pointer, not the object (a `ConfigMap` is about 400 bytes,
/// moved some ten times between the decoder and the cache).
#[derive(Clone, Debug)]
pub(crate) struct InArc<W: Decoder>(pub(crate) Arc<W::Object>);

/// How a watched object is decoded ([`Trimmed`], [`Whole`], either [`InArc`]), and the
/// object it yields.
pub(crate) trait Decoder {
    /// What the watch hands on.
    type Object;
    /// The object, out of its decoder.
    fn into_object(self) -> Self::Object;
}

impl<K> Decoder for Trimmed<K> {
    type Object = K;
    fn into_object(self) -> K {
        self.0
    }
}

impl<K> Decoder for Whole<K> {
    type Object = K;
    fn into_object(self) -> K {
        self.0
    }
}

impl<W: Decoder> Decoder for InArc<W> {
    type Object = Arc<W::Object>;
    fn into_object(self) -> Arc<W::Object> {
        self.0
    }
}

/// The event of the object an event of a decoder is.
pub(crate) fn decoded<W: Decoder>(event: Event<W>) -> Event<W::Object> {
    map_event(event, W::into_object)
}

/// `Resource` for a decoder of `$inner`: the same kind and paths, a scope that allows a
/// namespace.
macro_rules! wire_resource {
    ([$($generics:tt)*] $decoder:ty, $inner:ty, $this:ident => $meta:expr, $this_mut:ident => $meta_mut:expr) => {
        impl<$($generics)*> Resource for $decoder {
            type DynamicType = <$inner as Resource>::DynamicType;
            type Scope = kube::core::DynamicResourceScope;

            fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
                <$inner>::kind(dt)
            }

            fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
                <$inner>::group(dt)
            }

            fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
                <$inner>::version(dt)
            }

            fn api_version(dt: &Self::DynamicType) -> Cow<'_, str> {
                <$inner>::api_version(dt)
            }

            fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
                <$inner>::plural(dt)
            }

            fn metadata_api() -> bool {
                <$inner>::metadata_api()
            }

            fn url_path(dt: &Self::DynamicType, namespace: Option<&str>) -> String {
                <$inner>::url_path(dt, namespace)
            }

            fn meta(&self) -> &ObjectMeta {
                let $this = self;
                $meta
            }

            fn meta_mut(&mut self) -> &mut ObjectMeta {
                let $this_mut = self;
                $meta_mut
            }
        }
    };
}

wire_resource!([K: Resource + Clone] Trimmed<K>, K, this => this.0.meta(), this => this.0.meta_mut());
wire_resource!([K: Resource + Clone] Whole<K>, K, this => this.0.meta(), this => this.0.meta_mut());
// A decoded object's Arc is its only one: `make_mut` clones nothing.
wire_resource!(
    [W: Decoder<Object: Resource + Clone>] InArc<W>,
    W::Object,
    this => this.0.meta(),
    this => Arc::make_mut(&mut this.0).meta_mut()
);

impl<'de, K: de::Deserialize<'de>> de::Deserialize<'de> for Trimmed<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        K::deserialize(Object(deserializer)).map(Trimmed)
    }
}

impl<'de, K: de::Deserialize<'de>> de::Deserialize<'de> for Whole<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        K::deserialize(deserializer).map(Whole)
    }
}

impl<'de, W: Decoder + de::Deserialize<'de>> de::Deserialize<'de> for InArc<W> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        W::deserialize(deserializer).map(|w| InArc(Arc::new(w.into_object())))
    }
}

/// A map key as the input has it.
enum Key<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl Key<'_> {
    fn as_str(&self) -> &str {
        match self {
            Key::Borrowed(s) => s,
            Key::Owned(s) => s,
        }
    }
}

impl<'de> de::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Borrowed(s))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Key<'de>, E> {
                Ok(Key::Owned(s))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

/// Where a wrapped deserializer is: at the object (looking for `metadata`) or in its
/// metadata (skipping `managedFields`).
#[derive(Clone, Copy)]
enum Level {
    Object,
    Metadata,
}

/// Generates a deserializer wrapper whose maps (and, through options, their contents) are
/// read at `$level`; everything else goes to the inner deserializer as it is.
macro_rules! wrapper {
    ($name:ident, $level:expr) => {
        struct $name<D>(D);

        impl<'de, D: Deserializer<'de>> Deserializer<'de> for $name<D> {
            type Error = D::Error;

            fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
                self.0.deserialize_any(Wrapped(v, $level))
            }

            fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
                self.0.deserialize_map(Wrapped(v, $level))
            }

            fn deserialize_struct<V: Visitor<'de>>(
                self,
                name: &'static str,
                fields: &'static [&'static str],
                v: V,
            ) -> Result<V::Value, D::Error> {
                self.0.deserialize_struct(name, fields, Wrapped(v, $level))
            }

            fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
                self.0.deserialize_option(Wrapped(v, $level))
            }

            fn deserialize_newtype_struct<V: Visitor<'de>>(
                self,
                name: &'static str,
                v: V,
            ) -> Result<V::Value, D::Error> {
                self.0.deserialize_newtype_struct(name, Wrapped(v, $level))
            }

            fn is_human_readable(&self) -> bool {
                self.0.is_human_readable()
            }

            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
                bytes byte_buf unit unit_struct seq tuple tuple_struct enum identifier
                ignored_any
            }
        }
    };
}

wrapper!(Object, Level::Object);
wrapper!(Metadata, Level::Metadata);

/// A visitor whose maps are read at a level.
struct Wrapped<V>(V, Level);

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrapped<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.0.visit_map(Map {
            map,
            level: self.1,
            metadata_next: false,
        })
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        match self.1 {
            Level::Object => self.0.visit_some(Object(d)),
            Level::Metadata => self.0.visit_some(Metadata(d)),
        }
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        match self.1 {
            Level::Object => self.0.visit_newtype_struct(Object(d)),
            Level::Metadata => self.0.visit_newtype_struct(Metadata(d)),
        }
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_unit()
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<V::Value, E> {
        self.0.visit_bool(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<V::Value, E> {
        self.0.visit_i64(v)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<V::Value, E> {
        self.0.visit_u64(v)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<V::Value, E> {
        self.0.visit_f64(v)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<V::Value, E> {
        self.0.visit_str(v)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<V::Value, E> {
        self.0.visit_borrowed_str(v)
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<V::Value, E> {
        self.0.visit_string(v)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.0.visit_seq(seq)
    }
}

/// An object's map (its `metadata` value read at the metadata level) or its metadata's map
/// (without `managedFields`).
struct Map<A> {
    map: A,
    level: Level,
    /// The key just read was the object's `metadata`.
    metadata_next: bool,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Map<A> {
    type Error = A::Error;

    fn next_key_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        loop {
            let Some(key) = self.map.next_key::<Key<'de>>()? else {
                return Ok(None);
            };
            match self.level {
                Level::Object => self.metadata_next = key.as_str() == "metadata",
                Level::Metadata if key.as_str() == "managedFields" => {
                    self.map.next_value::<IgnoredAny>()?;
                    continue;
                }
                Level::Metadata => {}
            }
            return seed
                .deserialize(StrDeserializer::<A::Error>::new(key.as_str()))
                .map(Some);
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        if std::mem::take(&mut self.metadata_next) {
            self.map.next_value_seed(MetadataSeed(seed))
        } else {
            self.map.next_value_seed(seed)
        }
    }

    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint()
    }
}

/// The seed of an object's `metadata` value, read at the metadata level.
struct MetadataSeed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for MetadataSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Metadata(d))
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{DynamicObject, PartialObjectMeta};
    use kube::core::WatchEvent;
    use serde_json::json;

    use super::*;

    fn object() -> serde_json::Value {
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "a",
                "namespace": "n",
                "managedFields": [{
                    "manager": "kubectl",
                    "operation": "Apply",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:data": {"f:x": {}}, "f:metadata": {"f:labels": {"f:managedFields": {}}}}
                }],
                "labels": {"managedFields": "a label, kept"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                "resourceVersion": "7"
            },
            "data": {"managedFields": "a data key, kept", "x": "1"}
        })
    }

    /// Decoded as `K` would be, with managed fields dropped and nothing else.
    fn same_but_managed_fields<K>(text: &str)
    where
        K: Resource + de::DeserializeOwned + fmt::Debug,
    {
        let mut whole: K = serde_json::from_str(text).unwrap();
        assert!(whole.meta().managed_fields.is_some());
        whole.meta_mut().managed_fields = None;
        let trimmed: Trimmed<K> = serde_json::from_str(text).unwrap();
        // (Not every kind is `PartialEq`; their debug forms show every field.)
        assert_eq!(format!("{:?}", trimmed.0), format!("{whole:?}"));
    }

    #[test]
    fn objects_decode_whole_but_for_their_managed_fields() {
        let text = object().to_string();
        same_but_managed_fields::<ConfigMap>(&text);
        same_but_managed_fields::<DynamicObject>(&text);
        same_but_managed_fields::<PartialObjectMeta<ConfigMap>>(&text);
        // Keys in other orders, metadata last; escaped keys (not borrowed from the input).
        let text = r#"{"data":{"x":"1"},"kind":"ConfigMap","apiVersion":"v1","metadata":{"resourceVersion":"1","managedFields":[{"manager":"m"}],"n\u0061me":"b"}}"#;
        same_but_managed_fields::<ConfigMap>(text);
        let trimmed: Trimmed<ConfigMap> = serde_json::from_str(text).unwrap();
        assert_eq!(trimmed.0.metadata.name.as_deref(), Some("b"));
        // Metadata nested in the object (a pod template's) keeps its managed fields: only the
        // object's own lose them.
        let deployment = json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "managedFields": [{"manager": "m"}]},
            "spec": {
                "selector": {},
                "template": {
                    "metadata": {"labels": {"a": "b"}, "managedFields": [{"manager": "nested"}]},
                    "spec": {"containers": [{"name": "c"}]}
                }
            }
        });
        same_but_managed_fields::<Deployment>(&deployment.to_string());
        let trimmed: Trimmed<Deployment> = serde_json::from_value(deployment).unwrap();
        let template = trimmed.0.spec.unwrap().template.metadata.unwrap();
        assert_eq!(
            template.managed_fields.unwrap()[0].manager.as_deref(),
            Some("nested")
        );
    }

    #[test]
    fn watch_events_and_lists_of_trimmed_objects_decode() {
        let event = json!({"type": "ADDED", "object": object()}).to_string();
        let WatchEvent::Added(cm) =
            serde_json::from_str::<WatchEvent<Trimmed<ConfigMap>>>(&event).unwrap()
        else {
            panic!("not an ADDED event");
        };
        assert_eq!(cm.0.metadata.managed_fields, None);
        assert_eq!(cm.0.data.unwrap()["x"], "1");
        let list = json!({"apiVersion": "v1", "kind": "ConfigMapList", "metadata": {"resourceVersion": "9"}, "items": [object(), object()]});
        let list: kube::core::ObjectList<Trimmed<ConfigMap>> =
            serde_json::from_value(list).unwrap();
        assert!(
            list.items
                .iter()
                .all(|cm| cm.0.metadata.managed_fields.is_none())
        );
        // Malformed input is still an error.
        assert!(
            serde_json::from_str::<Trimmed<ConfigMap>>(r#"{"metadata": {"managedFields": [}}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<Trimmed<ConfigMap>>(r#"{"metadata": 3}"#).is_err());
    }
}
