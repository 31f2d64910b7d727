//! Where a member's API server sends its reviews: `<base path>/<cluster>/<token>/<webhook>`.
//!
//! The token is a keyed hash (HMAC-SHA-256) of the cluster's id under a key only the
//! replicas know: the administrator of one member reads its own URL in its own webhook
//! configuration, but cannot make the token of another cluster from it, so the path proves
//! which cluster's configuration a review came through. The apiserver adds
//! `?timeout=<n>s` itself: the query is not part of the route.

use ring::hmac;

/// The length of a route key, in bytes.
pub(crate) const KEY_LEN: usize = 32;

/// Domain separation: these tokens are for nothing else the key might ever sign.
const CONTEXT: &[u8] = b"multicluster-runtime webhook route\0";
/// The host's routes are made under their own context: a fleet cluster can never share
/// the host's token, whatever its id.
const HOST_CONTEXT: &[u8] = b"multicluster-runtime webhook host route\0";

/// Whose route a token is: a cluster of the fleet's, or the host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Fleet,
    Host,
}

impl Side {
    fn context(self) -> &'static [u8] {
        match self {
            Self::Fleet => CONTEXT,
            Self::Host => HOST_CONTEXT,
        }
    }
}

/// The mark of a cluster segment written in base64url: ids that are not plain names (empty,
/// `.` or `..`, or with any character outside `[A-Za-z0-9._-]`). The API server decodes a
/// URL's path before it sends the request (`%2F` arrives as `/`, and `.` segments are
/// cleaned away), so percent-encoding cannot carry such ids; base64url's alphabet and `~`
/// pass through unchanged.
const ENCODED: char = '~';

/// The keyed hashes routes are made and checked with: the current key, which makes tokens,
/// and the keys also accepted while the route key turns over (the previous one, whose
/// tokens members not yet given the new URLs still send; the next one, which a replica
/// that has already promoted it gives out).
#[derive(Clone)]
pub(crate) struct RouteKey {
    current: hmac::Key,
    also: Vec<hmac::Key>,
}

impl std::fmt::Debug for RouteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RouteKey(..)")
    }
}

impl RouteKey {
    /// One key, accepting its own tokens only.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn new(secret: &[u8]) -> Self {
        Self::with_accepted(secret, [])
    }

    /// `secret` makes tokens; its tokens and those of `accepted` are valid.
    pub(crate) fn with_accepted<'a>(
        secret: &[u8],
        accepted: impl IntoIterator<Item = &'a [u8]>,
    ) -> Self {
        Self {
            current: hmac::Key::new(hmac::HMAC_SHA256, secret),
            also: accepted
                .into_iter()
                .map(|key| hmac::Key::new(hmac::HMAC_SHA256, key))
                .collect(),
        }
    }

    /// The token of `cluster` (its id's text form) on `side`: 32 hexadecimal digits (128
    /// bits).
    pub(crate) fn token(&self, side: Side, cluster: &str) -> String {
        token(&self.current, side, cluster)
    }

    /// Whether `token` is `cluster`'s on `side` under any accepted key, compared in
    /// constant time.
    pub(crate) fn verify(&self, side: Side, cluster: &str, token: &str) -> bool {
        std::iter::once(&self.current)
            .chain(&self.also)
            .fold(false, |found, key| {
                found | same(&self::token(key, side, cluster), token)
            })
    }
}

fn token(key: &hmac::Key, side: Side, cluster: &str) -> String {
    let mut context = hmac::Context::with_key(key);
    context.update(side.context());
    context.update(cluster.as_bytes());
    let tag = context.sign();
    let mut out = String::with_capacity(32);
    for byte in &tag.as_ref()[..16] {
        use std::fmt::Write as _;
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// Whether `a` and `b` are equal, every byte compared whatever the first difference.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// A route of a request, split but not yet checked.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Route<'a> {
    /// The cluster id's text form, decoded.
    pub(crate) cluster: String,
    pub(crate) token: &'a str,
    pub(crate) webhook: &'a str,
}

/// Why a path is not a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotARoute {
    /// Not under the base path, or not three segments after it.
    Shape,
    /// The cluster segment is neither a plain name nor valid base64url of UTF-8.
    Encoding,
}

/// The path segment of a cluster id: the id itself when it is a plain name, else `~` and
/// its bytes in base64url without padding (the empty id is `~`).
pub(crate) fn encode_cluster(id: &str) -> String {
    if is_plain(id) {
        return id.to_string();
    }
    use base64::Engine as _;
    let mut out = String::from(ENCODED);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(id, &mut out);
    out
}

/// Whether `id` can stand in a path as it is.
fn is_plain(id: &str) -> bool {
    !id.is_empty()
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn decode_cluster(segment: &str) -> Result<String, NotARoute> {
    let Some(encoded) = segment.strip_prefix(ENCODED) else {
        return if is_plain(segment) {
            Ok(segment.to_string())
        } else if segment.is_empty() {
            Err(NotARoute::Shape)
        } else {
            Err(NotARoute::Encoding)
        };
    };
    use base64::Engine as _;
    let out = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .map_err(|_| NotARoute::Encoding)?;
    let id = String::from_utf8(out).map_err(|_| NotARoute::Encoding)?;
    // One spelling per id: a plain name written encoded is not a route.
    if is_plain(&id) || encode_cluster(&id) != segment {
        return Err(NotARoute::Encoding);
    }
    Ok(id)
}

/// The path (no query) of `cluster`'s `webhook` on `side` under `base` (no trailing
/// slash).
pub(crate) fn path(base: &str, key: &RouteKey, side: Side, cluster: &str, webhook: &str) -> String {
    format!(
        "{base}/{}/{}/{webhook}",
        encode_cluster(cluster),
        key.token(side, cluster)
    )
}

/// Splits `path` (the query already cut off) under `base`.
pub(crate) fn parse<'a>(base: &str, path: &'a str) -> Result<Route<'a>, NotARoute> {
    let rest = path.strip_prefix(base).ok_or(NotARoute::Shape)?;
    let rest = rest.strip_prefix('/').ok_or(NotARoute::Shape)?;
    let mut parts = rest.split('/');
    let (Some(cluster), Some(token), Some(webhook), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(NotARoute::Shape);
    };
    if token.is_empty() || webhook.is_empty() {
        return Err(NotARoute::Shape);
    }
    Ok(Route {
        cluster: decode_cluster(cluster)?,
        token,
        webhook,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_names_its_cluster_and_only_its_key_makes_its_token() {
        let key = RouteKey::new(&[7; KEY_LEN]);
        for id in [
            "east",
            "",
            "team a/prod",
            "ns/name",
            "ünï",
            "%41",
            "~",
            ".",
            "..",
            "a.b-c_d",
            "~x",
        ] {
            let path = path("/webhooks", &key, Side::Fleet, id, "owners.example.com");
            let route = parse("/webhooks", &path).unwrap();
            assert_eq!(route.cluster, id, "{path}");
            // What the API server's client would change: no `/` or `%` inside a segment, no
            // `.` or `..` segment.
            let segment = path.split('/').nth(2).unwrap();
            assert!(
                !segment.contains('%') && segment != "." && segment != "..",
                "{path}"
            );
            assert_eq!(route.webhook, "owners.example.com");
            assert!(key.verify(Side::Fleet, id, route.token));
            // Another cluster's id with this token, or another key: refused.
            assert!(!key.verify(Side::Fleet, &format!("{id}x"), route.token));
            assert!(!RouteKey::new(&[8; KEY_LEN]).verify(Side::Fleet, id, route.token));
        }
        assert_ne!(
            key.token(Side::Fleet, "east"),
            key.token(Side::Fleet, "west")
        );
        assert_eq!(key.token(Side::Fleet, "east").len(), 32);
        assert!(!key.verify(Side::Fleet, "east", ""));
        assert!(!key.verify(Side::Fleet, "east", &key.token(Side::Fleet, "east")[..31]));
    }

    #[test]
    fn the_hosts_tokens_are_made_under_their_own_context() {
        let key = RouteKey::new(&[7; KEY_LEN]);
        for id in ["host", "east", ""] {
            let (host, fleet) = (key.token(Side::Host, id), key.token(Side::Fleet, id));
            assert_ne!(
                host, fleet,
                "a fleet cluster under the host's id gets another token"
            );
            assert!(key.verify(Side::Host, id, &host) && !key.verify(Side::Host, id, &fleet));
            assert!(key.verify(Side::Fleet, id, &fleet) && !key.verify(Side::Fleet, id, &host));
        }
    }

    #[test]
    fn a_turning_key_accepts_the_tokens_of_its_other_keys_and_makes_its_own() {
        let (old, current, next) = ([1; KEY_LEN], [2; KEY_LEN], [3; KEY_LEN]);
        let ring = RouteKey::with_accepted(&current, [&old[..], &next[..]]);
        assert_eq!(
            ring.token(Side::Fleet, "east"),
            RouteKey::new(&current).token(Side::Fleet, "east")
        );
        for key in [old, current, next] {
            assert!(ring.verify(
                Side::Fleet,
                "east",
                &RouteKey::new(&key).token(Side::Fleet, "east")
            ));
        }
        assert!(!ring.verify(
            Side::Fleet,
            "east",
            &RouteKey::new(&[4; KEY_LEN]).token(Side::Fleet, "east")
        ));
        assert!(!ring.verify(
            Side::Fleet,
            "west",
            &RouteKey::new(&old).token(Side::Fleet, "east")
        ));
    }

    #[test]
    fn paths_of_another_shape_are_not_routes() {
        for path in [
            "/webhooks",
            "/webhooks/",
            "/webhooks/east/t",
            "/webhooks/east/t/w/x",
            "/webhooks//t/w",
            "/webhooks/east//w",
            "/webhooks/east/t/",
            "/other/east/t/w",
            "/webhooksx/east/t/w",
        ] {
            assert_eq!(parse("/webhooks", path), Err(NotARoute::Shape), "{path}");
        }
        for path in [
            "/webhooks/%41/t/w",
            "/webhooks/~*/t/w",
            "/webhooks/~Q/t/w",
            "/webhooks/~_w/t/w",
            "/webhooks/~ZWFzdA/t/w",
        ] {
            assert_eq!(parse("/webhooks", path), Err(NotARoute::Encoding), "{path}");
        }
        assert_eq!(parse("", "/east/t/w").unwrap().cluster, "east");
    }
}
