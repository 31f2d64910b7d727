//! Runs one request sequence against a real API server and the fake, side by side, and keeps
//! what a client observes of each, made comparable: uids, resource versions and generated
//! names become tokens numbered by first appearance, times become `<time>`, continue tokens
//! `<continue>`. Two transcripts that differ are a difference between the fake and the real
//! thing.

use std::collections::HashMap;
use std::fmt::Write as _;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt as _;
use kube::client::Body;
use serde_json::{Value, json};

/// How each side names the same thing: its uids, versions and generated names, as tokens.
#[derive(Default)]
struct Tokens {
    uids: HashMap<String, String>,
    rvs: HashMap<String, String>,
}

impl Tokens {
    fn token(map: &mut HashMap<String, String>, prefix: &str, value: &str) -> String {
        let n = map.len() + 1;
        map.entry(value.to_owned())
            .or_insert_with(|| format!("<{prefix}{n}>"))
            .clone()
    }
}

/// `fieldsV1` without its `.` entries (which say that a map or list itself is owned, as the
/// schema's map and struct types decide): the layout the comparison leaves out.
fn strip_markers(v: &mut Value) {
    if let Value::Object(m) = v {
        m.remove(".");
        for child in m.values_mut() {
            strip_markers(child);
        }
    }
}

/// An open watch: its body and the bytes of an unfinished line.
struct Watch {
    body: Body,
    pending: Vec<u8>,
}

/// One server: its client, what it has shown so far and what the sequence captured.
pub struct Side {
    pub client: kube::Client,
    tokens: Tokens,
    transcript: Vec<String>,
    captures: HashMap<String, String>,
    watches: HashMap<String, Watch>,
    last: Value,
}

impl Side {
    pub fn new(client: kube::Client) -> Self {
        Side {
            client,
            tokens: Tokens::default(),
            transcript: Vec::new(),
            captures: HashMap::new(),
            watches: HashMap::new(),
            last: Value::Null,
        }
    }

    fn fill(&self, text: &str, ns: &str) -> String {
        let mut out = text.replace("{ns}", ns);
        for (k, v) in &self.captures {
            out = out.replace(&format!("{{{k}}}"), v);
        }
        out
    }

    /// Makes a shown value comparable (see the module's comment).
    fn normalize(&mut self, v: &mut Value, field: Option<&str>) {
        match v {
            Value::Object(map) => {
                // Managed fields are compared by who wrote how (manager, operation,
                // subresource) and which fields, not by their times or order.
                if let Some(Value::Array(entries)) = map.remove("managedFields") {
                    let mut shown: Vec<String> = entries
                        .iter()
                        .map(|e| {
                            let mut fields = e["fieldsV1"].clone();
                            strip_markers(&mut fields);
                            format!(
                                "{}/{}/{}:{}",
                                e["manager"].as_str().unwrap_or_default(),
                                e["operation"].as_str().unwrap_or_default(),
                                e["subresource"].as_str().unwrap_or_default(),
                                fields
                            )
                        })
                        .collect();
                    shown.sort();
                    map.insert("managedFields".to_owned(), json!(shown));
                }
                for (k, child) in map.iter_mut() {
                    self.normalize(child, Some(k.as_str()));
                }
            }
            Value::Array(items) => {
                for item in items {
                    self.normalize(item, field);
                }
            }
            Value::String(s) => {
                let replaced = match field {
                    Some("uid") => Some(Tokens::token(&mut self.tokens.uids, "uid", s)),
                    Some("resourceVersion") => Some(Tokens::token(&mut self.tokens.rvs, "rv", s)),
                    Some(
                        "creationTimestamp" | "deletionTimestamp" | "lastTransitionTime" | "time"
                        | "eventTime" | "renewTime" | "acquireTime",
                    ) => Some("<time>".to_owned()),
                    Some("continue") if !s.is_empty() => Some("<continue>".to_owned()),
                    Some("message") => Some(self.tokenize_words(s)),
                    _ => None,
                };
                if let Some(r) = replaced {
                    *s = r;
                }
            }
            _ => {}
        }
    }

    /// A message with the uids and versions it quotes as their tokens (whole words only).
    fn tokenize_words(&self, text: &str) -> String {
        let mut out = String::new();
        let mut word = String::new();
        let flush = |word: &mut String, out: &mut String| {
            let t = self
                .tokens
                .uids
                .get(word.as_str())
                .or_else(|| self.tokens.rvs.get(word.as_str()));
            out.push_str(t.map_or(word.as_str(), String::as_str));
            word.clear();
        };
        for c in text.chars() {
            if c.is_ascii_alphanumeric() || c == '-' {
                word.push(c);
            } else {
                flush(&mut word, &mut out);
                out.push(c);
            }
        }
        flush(&mut word, &mut out);
        out
    }

    fn note(&mut self, line: String) {
        self.transcript.push(line);
    }

    async fn request(
        &mut self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Option<&Value>,
        ns: &str,
    ) {
        let template = path;
        let path = self.fill(path, ns);
        let body_bytes = body
            .map(|b| self.fill(&b.to_string(), ns).into_bytes())
            .unwrap_or_default();
        let mut req = Request::builder().method(method).uri(&path);
        if let Some(ct) = content_type {
            req = req.header(http::header::CONTENT_TYPE, ct);
        } else if body.is_some() {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = req.body(Body::from(body_bytes)).expect("a request");
        let res = self.client.send(req).await.expect("the server answers");
        let code = res.status().as_u16();
        let bytes = res
            .into_body()
            .collect()
            .await
            .expect("a whole body")
            .to_bytes();
        let mut v: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&bytes)}));
        self.last = v.clone();
        self.normalize(&mut v, None);
        self.note(format!("{method} {template} -> {code} {v}"));
    }

    async fn open_watch(&mut self, id: &str, path: &str, ns: &str) {
        let path = self.fill(path, ns);
        let req = Request::builder()
            .method("GET")
            .uri(&path)
            .body(Body::from(Vec::new()))
            .expect("a request");
        let res = self.client.send(req).await.expect("the server answers");
        let code = res.status().as_u16();
        self.note(format!("WATCH {id} -> {code}"));
        self.watches.insert(
            id.to_owned(),
            Watch {
                body: res.into_body(),
                pending: Vec::new(),
            },
        );
    }

    /// Reads watch `id` until an event whose object is named `until` (or an ERROR), noting
    /// every event but bookmarks (the real server sends those when it likes).
    async fn read_watch(&mut self, id: &str, until: &str) {
        let mut lines = Vec::new();
        let Some(watch) = self.watches.get_mut(id) else {
            panic!("no watch {id}")
        };
        'read: loop {
            while let Some(end) = watch.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = watch.pending.drain(..=end).collect();
                let event: Value = serde_json::from_slice(&line).expect("a watch event");
                let kind = event["type"].as_str().unwrap_or_default().to_owned();
                let name = event
                    .pointer("/object/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let initial_end = event
                    .pointer("/object/metadata/annotations/k8s.io~1initial-events-end")
                    .is_some();
                if kind != "BOOKMARK" || initial_end {
                    lines.push(event);
                }
                if name == until || kind == "ERROR" {
                    break 'read;
                }
            }
            let frame =
                tokio::time::timeout(std::time::Duration::from_secs(20), watch.body.frame())
                    .await
                    .unwrap_or_else(|_| panic!("watch {id}: no event named {until} within 20 s"));
            match frame {
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        let data: Bytes = data;
                        watch.pending.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => panic!("watch {id}: {e}"),
                None => {
                    lines.push(json!({"type": "<end of stream>"}));
                    break;
                }
            }
        }
        for mut event in lines {
            self.normalize(&mut event, None);
            self.note(format!("EVENT {id} {event}"));
        }
    }
}

/// A sequence run on both servers in a namespace of its own.
pub struct Pair {
    pub real: Side,
    pub fake: Side,
    pub ns: String,
    pub name: String,
}

impl Pair {
    pub fn new(name: &str, real: kube::Client, fake: kube::Client) -> Self {
        Pair {
            real: Side::new(real),
            fake: Side::new(fake),
            ns: format!("diff-{name}"),
            name: name.to_owned(),
        }
    }

    /// A request on both sides; `path` and `body` may hold `{ns}` and `{capture}` names.
    pub async fn req(&mut self, method: &str, path: &str, body: Option<Value>) {
        self.req_typed(method, path, None, body).await;
    }

    pub async fn req_typed(
        &mut self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Option<Value>,
    ) {
        let ns = self.ns.clone();
        self.real
            .request(method, path, content_type, body.as_ref(), &ns)
            .await;
        self.fake
            .request(method, path, content_type, body.as_ref(), &ns)
            .await;
    }

    /// Keeps a field of the last answer (a JSON pointer) under `name`, each side its own.
    pub fn capture(&mut self, name: &str, pointer: &str) {
        for side in [&mut self.real, &mut self.fake] {
            let v = side
                .last
                .pointer(pointer)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            side.captures.insert(name.to_owned(), v);
        }
    }

    pub async fn watch(&mut self, id: &str, path: &str) {
        let ns = self.ns.clone();
        self.real.open_watch(id, path, &ns).await;
        self.fake.open_watch(id, path, &ns).await;
    }

    pub async fn read_watch(&mut self, id: &str, until: &str) {
        self.real.read_watch(id, until).await;
        self.fake.read_watch(id, until).await;
    }

    /// The real server's transcript (shown with `MCR_DIFF_SHOW=<sequence>`).
    pub fn show(&self) {
        if std::env::var("MCR_DIFF_SHOW").is_ok_and(|s| s == self.name) {
            for line in &self.real.transcript {
                eprintln!("{line}");
            }
        }
    }

    /// How many requests and events were compared.
    pub fn len(&self) -> usize {
        self.real.transcript.len()
    }

    /// The places where the two transcripts differ (the first five), if any.
    pub fn difference(&self) -> Option<String> {
        let (r, f) = (&self.real.transcript, &self.fake.transcript);
        let mut out = String::new();
        let mut shown = 0;
        for i in 0..r.len().max(f.len()) {
            let (a, b) = (r.get(i), f.get(i));
            if a != b && shown < 5 {
                shown += 1;
                let _ = writeln!(out, "{}: step {} differs", self.name, i + 1);
                let _ = writeln!(out, "  real: {}", a.map_or("<nothing>", String::as_str));
                let _ = writeln!(out, "  fake: {}", b.map_or("<nothing>", String::as_str));
            }
        }
        (shown > 0).then_some(out)
    }
}
