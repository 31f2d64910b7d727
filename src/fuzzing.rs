//! The bodies of the fuzz targets in `fuzz/`, and of the test that replays their corpora on
//! the stable toolchain (`tests/fuzz_seeds.rs`). Each takes arbitrary bytes and panics
//! only when an invariant of the library breaks.
//!
//! Not a public API: it exists for `fuzz/` and is only compiled with the `fuzzing` feature.
//! Panicking is how these bodies report a broken invariant, hence the `expect`s.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use futures::FutureExt;

use crate::cluster::{ClusterName, SingleCluster};
use crate::controller::{Action, Request};
use crate::controller::{FleetQueue, ReconcileReason};
use crate::providers::{ApiPath, File, Multi, Target, Trust};

/// The names of the targets, as in `fuzz/fuzz_targets/<name>.rs` and `fuzz/corpus/<name>/`.
pub const TARGETS: [&str; 9] = [
    "request_text",
    "cluster_names",
    "queue",
    "kubeconfig",
    "namespace_scope",
    "object_decoding",
    "access_providers",
    "webhook_review",
    "owner_records",
];

/// Runs the target called `name` on `data`; false for an unknown name.
pub fn run(name: &str, data: &[u8]) -> bool {
    match name {
        "request_text" => request_text(data),
        "cluster_names" => cluster_names(data),
        "queue" => queue(data),
        "kubeconfig" => kubeconfig(data),
        "namespace_scope" => namespace_scope(data),
        "object_decoding" => object_decoding(data),
        "access_providers" => access_providers(data),
        "webhook_review" => webhook_review(data),
        "owner_records" => owner_records(data),
        _ => return false,
    }
    true
}

/// Splits `data` into up to `n` UTF-8 strings at NUL bytes (invalid UTF-8 replaced).
fn fields(data: &[u8], n: usize) -> Vec<String> {
    let mut out: Vec<String> = data
        .splitn(n, |b| *b == 0)
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect();
    out.resize(n, String::new());
    out
}

/// 1. `Request`'s text form: whatever parses prints back to a string that parses to the same
///    request; a request built from any parts survives printing and parsing.
pub fn request_text(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(request) = text.parse::<Request<ClusterName>>() {
            let printed = request.to_string();
            let again: Request<ClusterName> = printed
                .parse()
                .unwrap_or_else(|e| panic!("{printed:?} (from {text:?}) does not parse: {e}"));
            assert_eq!(again, request, "{text:?} -> {printed:?}");
            assert_eq!(again.to_string(), printed);
        }
        if let Ok(request) = text.parse::<Request<SingleCluster>>() {
            let again: Request<SingleCluster> = request.to_string().parse().expect("reparses");
            assert_eq!(again, request);
        }
    }
    let [cluster, namespace, name, flag] = <[String; 4]>::try_from(fields(data, 4)).expect("4");
    let namespace = (!flag.is_empty()).then_some(namespace);
    let request = Request::new(ClusterName::from(cluster), namespace, name);
    let printed = request.to_string();
    let again: Request<ClusterName> = printed
        .parse()
        .unwrap_or_else(|e| panic!("{request:?} printed as {printed:?} does not parse: {e}"));
    assert_eq!(again, request, "{printed:?}");
}

/// 2. Composite cluster names: `Multi`'s `<child><sep><cluster>` (nested too) and `File`'s
///    `<path>+<context>` split back into exactly what they were joined from, including
///    names that contain the separator; and they survive a request's text form.
pub fn cluster_names(data: &[u8]) {
    let [separator, child, inner, cluster, path, context] =
        <[String; 6]>::try_from(fields(data, 6)).expect("6");
    let multi = Multi::with_separator(&separator);
    if !child.is_empty() && !child.contains(multi.separator()) && !multi.accepts_name(&child) {
        // Refused only when the name ends with the start of the separator.
        let sep = multi.separator();
        assert!(
            (1..sep.len()).any(|i| sep.is_char_boundary(i) && child.ends_with(&sep[..i])),
            "{child:?} refused with separator {sep:?}"
        );
    }
    if multi.accepts_name(&child) {
        let name = multi.join(&child, &cluster);
        assert_eq!(
            multi.split(&name),
            Some((child.as_str(), cluster.as_str())),
            "{name}"
        );
        // A Multi inside a Multi.
        if multi.accepts_name(&inner) {
            let nested = multi.join(&child, multi.join(&inner, &cluster).as_str());
            let (outer, rest) = multi.split(&nested).expect("splits");
            assert_eq!(outer, child);
            assert_eq!(
                multi.split(&ClusterName::from(rest)),
                Some((inner.as_str(), cluster.as_str()))
            );
        }
        let request = Request::new(name.clone(), Some("ns"), "o");
        let again: Request<ClusterName> = request.to_string().parse().expect("reparses");
        assert_eq!(again.cluster, name);
    }
    let name = File::default_name(Path::new(&path), &context);
    let (p, c) = File::split_name(&name).unwrap_or_else(|| panic!("{name:?} does not split"));
    assert_eq!(
        (p.to_string_lossy().as_ref(), c.as_str()),
        (path.as_str(), context.as_str()),
        "{name}"
    );
    // Names that File could not have made are refused or split into something that joins
    // back to them; never a panic.
    if let Some((p, c)) = File::split_name(&cluster) {
        assert_eq!(File::default_name(&p, &c), cluster);
    }
}

/// 3. The fleet queue as a state machine, on paused time: engage, disengage, watch events,
///    a mapper fanning out to other clusters, reconciles starting and finishing with or
///    without a requeue, time passing. After every step: at most one reconcile in flight per
///    request, none for a cluster that is not engaged, none that nothing asked for, the
///    concurrency limit kept; at the end, every request triggered for a cluster that stayed
///    engaged has been reconciled.
pub fn queue(data: &[u8]) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
    else {
        return;
    };
    runtime.block_on(queue_machine(data));
}

const CLUSTERS: [&str; 3] = ["a", "b", "c"];
const OBJECTS: [&str; 4] = ["w", "x", "y", "z"];

struct Model {
    engaged: HashSet<ClusterName>,
    in_flight: Vec<Request<ClusterName>>,
    /// Requests that must still be reconciled (triggered or requeued while engaged).
    owed: HashSet<Request<ClusterName>>,
    /// Per request, triggers and requeues not yet matched by a start: a start needs one
    /// (deduplication lets one start answer several).
    credits: std::collections::HashMap<Request<ClusterName>, usize>,
    concurrency: usize,
}

impl Model {
    fn started(&mut self, request: Request<ClusterName>) {
        assert!(
            !self.in_flight.contains(&request),
            "{request} runs twice at once"
        );
        assert!(
            self.engaged.contains(&request.cluster),
            "{request} started for a cluster that is not engaged"
        );
        assert!(
            self.concurrency == 0 || self.in_flight.len() < self.concurrency,
            "more than {} reconciles at once",
            self.concurrency
        );
        let credits = self.credits.entry(request.clone()).or_default();
        assert!(
            *credits > 0,
            "{request} started without a trigger or requeue"
        );
        *credits -= 1;
        self.owed.remove(&request);
        self.in_flight.push(request);
    }

    fn asked(&mut self, request: &Request<ClusterName>) {
        *self.credits.entry(request.clone()).or_default() += 1;
    }
}

async fn queue_machine(data: &[u8]) {
    let mut bytes = data.iter().copied();
    let mut byte = move || bytes.next();
    let Some(setup) = byte() else { return };
    let concurrency = usize::from(setup % 4);
    let debounce = Duration::from_millis([0, 10, 250, 1000][usize::from(setup / 4 % 4)]);
    let mut queue = FleetQueue::<ClusterName>::new(concurrency, 0, debounce);
    let mut model = Model {
        engaged: HashSet::new(),
        in_flight: Vec::new(),
        owed: HashSet::new(),
        credits: std::collections::HashMap::new(),
        concurrency,
    };
    let request = |b: u8| {
        Request::new(
            ClusterName::from(CLUSTERS[usize::from(b) % 3]),
            Some("ns"),
            OBJECTS[usize::from(b / 3) % 4],
        )
    };
    while let Some(op) = byte() {
        let arg = byte().unwrap_or(0);
        match op % 8 {
            0 => {
                let cluster = ClusterName::from(CLUSTERS[usize::from(arg) % 3]);
                queue.engage(cluster.clone());
                model.engaged.insert(cluster);
            }
            1 => {
                let cluster = ClusterName::from(CLUSTERS[usize::from(arg) % 3]);
                queue.disengage(&cluster);
                model.engaged.remove(&cluster);
                model.owed.retain(|r| r.cluster != cluster);
            }
            2 => {
                // A watch event for an object.
                let request = request(arg);
                if model.engaged.contains(&request.cluster) {
                    model.owed.insert(request.clone());
                }
                model.asked(&request);
                // Listed objects go to the low lane: served later, never lost.
                let reason = if arg & 0x80 == 0 {
                    ReconcileReason::ObjectChanged
                } else {
                    ReconcileReason::Listed
                };
                queue.trigger(request, reason);
            }
            3 => {
                // A mapper: one event, the same object in every cluster.
                for cluster in CLUSTERS {
                    let mut request = request(arg);
                    request.cluster = ClusterName::from(cluster);
                    if model.engaged.contains(&request.cluster) {
                        model.owed.insert(request.clone());
                    }
                    model.asked(&request);
                    queue.trigger(
                        request,
                        ReconcileReason::RelatedObjectChanged("ConfigMap".into()),
                    );
                }
            }
            4 | 5 => {
                if let Some((request, _)) = queue.next().now_or_never() {
                    model.started(request);
                }
            }
            6 => {
                if model.in_flight.is_empty() {
                    continue;
                }
                let request = model
                    .in_flight
                    .remove(usize::from(arg) % model.in_flight.len());
                let action = match arg % 4 {
                    0 | 1 => Action::await_change(),
                    2 => Action::requeue(Duration::from_millis(u64::from(arg) * 20)),
                    _ => Action::requeue(Duration::MAX),
                };
                if action
                    .requeue_after()
                    .is_some_and(|d| d < Duration::from_secs(3600))
                    && model.engaged.contains(&request.cluster)
                {
                    model.owed.insert(request.clone());
                }
                if action.requeue_after().is_some() {
                    model.asked(&request);
                }
                queue.finish(request, action, ReconcileReason::Requeue, None);
            }
            _ => tokio::time::advance(Duration::from_millis(u64::from(arg) * 10)).await,
        }
    }
    // No loss: finish what runs, let an hour pass, and serve everything that comes due.
    loop {
        for request in std::mem::take(&mut model.in_flight) {
            queue.finish(
                request,
                Action::await_change(),
                ReconcileReason::Requeue,
                None,
            );
        }
        match tokio::time::timeout(Duration::from_secs(3600), queue.next()).await {
            Ok((request, _)) => model.started(request),
            Err(_) => break,
        }
    }
    assert!(model.owed.is_empty(), "never reconciled: {:?}", model.owed);
}

/// 4. Kubeconfig bytes as providers receive them (from a file or a Secret): parsing,
///    refusing exec plugins, auth-providers and local files where the provider forbids
///    them, and building the client configuration and the client of every context;
///    errors, never panics. The configurations built from a kubeconfig the Secret provider
///    accepts name no command and no local file. (Configurations that may run or read
///    something are not built here.) No error holds a byte of the kubeconfig: the same
///    bytes with a secret-looking marker planted at a point the input chooses (the upper
///    six bits of its first byte) give errors without the marker, wherever it breaks the
///    document.
pub fn kubeconfig(data: &[u8]) {
    let Some((&flags, data)) = data.split_first() else {
        return;
    };
    let trust = Trust {
        exec: flags & 1 == 1,
        local_files: flags & 2 == 2,
    };
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    // The input as given: its errors only have to come back.
    drop(runtime.block_on(kubeconfig_errors(data, trust)));
    const MARKER: &[u8] = b"s3cr3t-T0KEN-marker";
    let at = data.len() * usize::from(flags >> 2) / 64;
    let planted = [&data[..at], MARKER, &data[at..]].concat();
    for error in runtime.block_on(kubeconfig_errors(&planted, trust)) {
        assert!(
            !error.contains("s3cr3t-T0KEN-marker"),
            "an error quotes the kubeconfig: {error}"
        );
    }
}

/// Every error reading `data` the way the Secret provider does gives: parsing and
/// refusal, then, for each context (at most four) and the current one, building its
/// configuration and its client.
async fn kubeconfig_errors(data: &[u8], trust: Trust) -> Vec<String> {
    let kubeconfig = match crate::providers::parse_kubeconfig(data, trust) {
        Ok(kubeconfig) => kubeconfig,
        Err(error) => return vec![error],
    };
    if trust.exec || trust.local_files {
        // Accepted kubeconfigs that may run commands or read files are not built here.
        return Vec::new();
    }
    let mut errors = Vec::new();
    let contexts = kubeconfig
        .contexts
        .iter()
        .take(4)
        .map(|c| Some(c.name.clone()));
    for context in contexts.chain([None]) {
        let config =
            match crate::providers::config_from_kubeconfig(kubeconfig.clone(), context).await {
                Ok(config) => config,
                Err(error) => {
                    errors.push(error);
                    continue;
                }
            };
        // What was built, not what was parsed: nothing that runs or reads anything.
        // (The messages name fields, not values: a harness is held to the crate's rules.)
        let auth = &config.auth_info;
        assert!(
            auth.exec.is_none() && auth.auth_provider.is_none(),
            "a refused kubeconfig runs a program (exec: {}, auth-provider: {})",
            auth.exec.is_some(),
            auth.auth_provider.is_some()
        );
        assert!(
            auth.token_file.is_none()
                && auth.client_certificate.is_none()
                && auth.client_key.is_none()
                && config.root_cert_file.is_none(),
            "a refused kubeconfig reads local files"
        );
        // secrets-lint: the error is put in fixed words (describe_client).
        if let Err(error) = kube::Client::try_from(config) {
            errors.push(crate::providers::describe_client(&error));
        }
    }
    errors
}

/// 5. The namespace provider's scoping of request paths and bodies, against the API
///    server's own reading of a path (its request-info rules, rewritten here): a path the
///    server reads as an object in a namespace is moved into the cluster's namespace and
///    read by the server as the same resource, name and subresource there; a path the
///    server does not read as namespaced is never rewritten; a rewritten body names the
///    new namespace; nothing panics.
pub fn namespace_scope(data: &[u8]) {
    let [path, namespace, body] = <[String; 3]>::try_from(fields(data, 3)).expect("3");
    if crate::providers::is_plain_path(&path)
        && let Some(server) = ServerReading::of(&path)
    {
        match ApiPath::parse(&path).map(|p| (p.target.clone(), p)) {
            Some((Target::Namespaced { rest, .. }, parsed)) => {
                let scoped = parsed.in_namespace("zoo", &rest);
                assert!(
                    crate::providers::is_plain_path(&scoped),
                    "{path:?} -> {scoped:?}"
                );
                let moved = ServerReading::of(&scoped)
                    .unwrap_or_else(|| panic!("{scoped:?} (from {path:?}) is not an API path"));
                assert_eq!(
                    moved.namespace.as_deref(),
                    Some("zoo"),
                    "{path:?} -> {scoped:?}"
                );
                assert_eq!(
                    (moved.resource, moved.name, moved.subresource),
                    (server.resource, server.name, server.subresource),
                    "{path:?} -> {scoped:?}"
                );
                assert_eq!(
                    ApiPath::parse(&scoped).map(|p| p.target),
                    Some(Target::Namespaced {
                        namespace: "zoo",
                        rest: rest.clone()
                    }),
                    "{scoped:?}"
                );
            }
            Some((Target::Unqualified { resource, rest }, _)) => {
                // Not in a namespace for the server either (the Namespace object itself
                // aside, which the server files under its own name).
                let namespace_object = resource == "namespaces"
                    && server.namespace.as_deref() == rest.first().copied();
                assert!(
                    server.namespace.is_none() || namespace_object,
                    "{path:?}: the server reads namespace {:?}",
                    server.namespace
                );
            }
            Some((Target::Discovery, _)) | None => {}
        }
    }
    let namespace = if namespace.is_empty() {
        "zoo"
    } else {
        &namespace
    };
    if let Ok(Some(out)) = crate::providers::with_namespace(body.as_bytes(), namespace) {
        let value: serde_json::Value = serde_json::from_slice(&out).expect("rewritten JSON");
        assert_eq!(value["metadata"]["namespace"], namespace);
    }
}

/// How the API server reads a resource path (its request-info rules): the namespace, the
/// resource, the name and what follows.
#[derive(Debug)]
struct ServerReading {
    namespace: Option<String>,
    resource: String,
    name: Option<String>,
    subresource: Vec<String>,
}

impl ServerReading {
    /// `None` for paths that name no resource (outside `/api` and `/apis`, discovery).
    fn of(path: &str) -> Option<Self> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let mut parts: &[&str] = match *parts.first()? {
            "api" if parts.len() >= 2 => &parts[2..],
            "apis" if parts.len() >= 3 => &parts[3..],
            _ => return None,
        };
        if parts.first() == Some(&"watch") {
            parts = &parts[1..];
        }
        let mut namespace = None;
        if parts.first() == Some(&"namespaces") && parts.len() > 1 {
            namespace = Some(parts[1].to_string());
            if parts.len() > 2 && !matches!(parts[2], "status" | "finalize") {
                parts = &parts[2..];
            }
        }
        let (resource, rest) = parts.split_first()?;
        Some(Self {
            namespace,
            resource: resource.to_string(),
            name: rest.first().map(|s| s.to_string()),
            subresource: rest.iter().skip(1).map(|s| s.to_string()).collect(),
        })
    }
}

/// 6. Decoding without managed fields (`cluster::trim`): whatever decodes as a ConfigMap or a
///    `DynamicObject` decodes trimmed to the same object without its managed fields; whatever
///    fails trimmed fails whole too (skipping `managedFields` accepts any JSON value there, so
///    the converse need not hold). Decoded into an `Arc` (`InArc<Trimmed<K>>`, as the fleet's
///    caches decode), it is the same object, and fails where the trimmed decoding fails.
pub fn object_decoding(data: &[u8]) {
    use crate::cache::trim::{InArc, Trimmed};
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::Resource;
    use kube::api::DynamicObject;

    fn check<K: Resource + serde::de::DeserializeOwned + std::fmt::Debug>(text: &str) {
        let whole = serde_json::from_str::<K>(text);
        let trimmed = serde_json::from_str::<Trimmed<K>>(text);
        let shared = serde_json::from_str::<InArc<Trimmed<K>>>(text);
        match (&trimmed, shared) {
            (Ok(trimmed), Ok(shared)) => {
                assert_eq!(
                    format!("{:?}", trimmed.0),
                    format!("{:?}", shared.0),
                    "{text:?}"
                );
            }
            (Err(_), Err(_)) => {}
            (Ok(_), Err(e)) => panic!("{text:?} decodes trimmed but not into an Arc: {e}"),
            (Err(e), Ok(_)) => panic!("{text:?} decodes into an Arc but not trimmed: {e}"),
        }
        match (whole, trimmed) {
            (Ok(mut whole), Ok(trimmed)) => {
                whole.meta_mut().managed_fields = None;
                assert_eq!(format!("{:?}", trimmed.0), format!("{whole:?}"), "{text:?}");
            }
            (Ok(_), Err(e)) => panic!("{text:?} decodes whole but not trimmed: {e}"),
            (Err(_), _) => {}
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        check::<ConfigMap>(text);
        check::<DynamicObject>(text);
    }
}

/// 7. The Cluster Inventory API's access providers: an operator's file (`from_json`) and a
///    profile's status, both arbitrary (NUL-separated; an unusable file is replaced by a
///    fixed one with every policy). Never a panic; when a kubeconfig comes out, its access
///    provider is the first of the file's order that the profile lists, it runs that
///    provider's command, the plugin's arguments start with the file's (and are exactly
///    them unless the policy is `Append`), every variable of the file is there, with the
///    file's value unless the policy is `Replace`, the profile's variables are only those a
///    profile may set, none set is removed again, and none of the profile's TLS overrides or
///    local paths is taken.
pub fn access_providers(data: &[u8]) {
    use crate::providers::AccessProviders;
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};

    const FIXED: &str = r#"{"providers": [
        {"name": "a", "execConfig": {"command": "/a", "args": ["--a"],
         "env": [{"name": "A", "value": "file"}]}},
        {"name": "b", "execConfig": {"command": "/b", "args": ["--b"],
         "env": [{"name": "B", "value": "file"}]},
         "profileSourcedCLIArgsPolicy": "Append", "profileSourcedEnvVarsPolicy": "Replace"},
        {"name": "c", "execConfig": {"command": "/c"},
         "profileSourcedEnvVarsPolicy": "AppendIfNotExists"}]}"#;
    let [file, status] = <[String; 2]>::try_from(fields(data, 2)).expect("two fields");
    let providers = AccessProviders::from_json(&file)
        .unwrap_or_else(|_| AccessProviders::from_json(FIXED).expect("the fixed file parses"));
    let Ok(status) = serde_json::from_str::<serde_json::Value>(&status) else {
        return;
    };
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "multicluster.x-k8s.io",
        "v1alpha1",
        "ClusterProfile",
    ));
    let profile = DynamicObject::new("p", &resource)
        .within("ns")
        .data(serde_json::json!({ "status": status }));
    let Ok((name, kubeconfig)) = providers.kubeconfig_for(&profile) else {
        return;
    };
    let listed = |list: &str| {
        status[list]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["name"].as_str())
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let profile_lists: Vec<String> =
        [listed("accessProviders"), listed("credentialProviders")].concat();
    let first = providers
        .names()
        .find(|n| profile_lists.iter().any(|l| l == n))
        .expect("a provider was chosen, so the profile lists one of the file's");
    assert_eq!(name, first);
    let plugin = providers
        .plugin_of(&name)
        .expect("the chosen provider has a plugin");
    let exec = kubeconfig.auth_infos[0]
        .auth_info
        .as_ref()
        .and_then(|a| a.exec.as_ref())
        .expect("an exec user");
    assert_eq!(exec.command.as_deref(), Some(plugin.command));
    let args = exec.args.clone().unwrap_or_default();
    assert!(
        args.starts_with(plugin.args),
        "{args:?} after {:?}",
        plugin.args
    );
    if !plugin.appends_args {
        assert_eq!(args, plugin.args);
    }
    let env: Vec<(String, String)> = exec
        .env
        .iter()
        .flatten()
        .map(|v| (v["name"].clone(), v["value"].clone()))
        .collect();
    for (key, value) in &plugin.env {
        let got = env
            .iter()
            .find(|(k, _)| k == *key)
            .expect("the file's variable is kept");
        if !plugin.replaces_env {
            assert_eq!(&got.1, *value);
        }
    }
    // A profile adds only variables it may set, and nothing set is removed again.
    for (key, _) in &env {
        assert!(
            plugin.env.iter().any(|(k, _)| k == &key)
                || (crate::providers::profile_may_set(key) && plugin.allowed_env.contains(key)),
            "a profile set {key}"
        );
        assert!(
            !exec.drop_env.iter().flatten().any(|d| d == key),
            "{key} set and removed"
        );
    }
    // Of the profile's cluster, no TLS override (the fuzzed files never allow them) and no
    // local path.
    let cluster = kubeconfig.clusters[0].cluster.as_ref().expect("a cluster");
    assert!(
        cluster.insecure_skip_tls_verify.is_none()
            && cluster.tls_server_name.is_none()
            && cluster.disable_compression.is_none()
            && cluster.certificate_authority.is_none(),
        "a profile's TLS settings or paths were taken"
    );
}

/// 8. The webhook server's routing and review handling: an arbitrary path and body (and a
///    cluster id, NUL-separated). Never a panic. A path routes only to a served cluster
///    whose token it carries; the path made for a served cluster routes back to it and
///    webhook, with another cluster's token it is refused as `BadToken`, and for a cluster
///    not served as `UnknownCluster`. Every answer to a body is an `AdmissionReview` of
///    `admission.k8s.io/v1` with a response whose uid is the request's when the body has
///    one; a validating answer never carries a patch; a mutating answer's patch applies to
///    the request's object.
pub fn webhook_review(data: &[u8]) {
    use std::collections::HashMap;

    use k8s_openapi::api::core::v1::ConfigMap;

    use crate::webhook::route;
    use crate::webhook::route::RouteKey;
    use crate::webhook::{
        FailurePolicy, Mutation, Refusal, Review, Verdict, review, route_request,
    };

    let [path, body, id, flag] = <[String; 4]>::try_from(fields(data, 4)).expect("4");
    let key = RouteKey::new(&[3; route::KEY_LEN]);
    let served = ["east", "", "team a/prod"];
    let serves = |c: &ClusterName| served.contains(&c.as_str());
    let hooks: HashMap<String, u8> = HashMap::from([("v.example.com".to_string(), 0)]);
    // Arbitrary paths: routed only with the right token to a served cluster.
    let host = ClusterName::from("east");
    for host in [None, Some(&host)] {
        let Ok((cluster, _)) =
            route_request::<ClusterName, _>("/base", &hooks, &key, host, serves, &path)
        else {
            continue;
        };
        assert!(serves(&cluster), "{path:?} routed to {cluster}");
        let token = path.rsplit('/').nth(1).expect("a route has a token");
        let side = if host == Some(&cluster) {
            route::Side::Host
        } else {
            route::Side::Fleet
        };
        assert!(key.verify(side, cluster.as_str(), token), "{path:?}");
    }
    // Made paths: back to their cluster; another's token or an unserved cluster refused.
    let made = route::path("/base", &key, route::Side::Fleet, &id, "v.example.com");
    let routed = route_request::<ClusterName, _>("/base", &hooks, &key, None, serves, &made);
    let expected = if served.contains(&id.as_str()) {
        Ok(id.clone())
    } else {
        Err(Refusal::UnknownCluster)
    };
    assert_eq!(
        routed.map(|(c, _)| c.as_str().to_string()),
        expected,
        "{made:?}"
    );
    let other = if id == "east" { "" } else { "east" };
    let forged = made.replacen(
        &key.token(route::Side::Fleet, &id),
        &key.token(route::Side::Fleet, other),
        1,
    );
    assert_eq!(
        route_request::<ClusterName, _>("/base", &hooks, &key, None, serves, &forged).map(|_| ()),
        Err(Refusal::BadToken),
        "{forged:?}"
    );
    // The fleet's token of the host's id is not the host's.
    let as_host = ClusterName::from(id.as_str());
    assert!(
        route_request::<ClusterName, _>("/base", &hooks, &key, Some(&as_host), serves, &made)
            .is_err(),
        "{made:?}"
    );
    // Reviews.
    let policy = if flag.is_empty() {
        FailurePolicy::Fail
    } else {
        FailurePolicy::Ignore
    };
    let settings = review::Settings {
        name: std::sync::Arc::from("v.example.com"),
        failure_policy: policy,
    };
    let validating = review::validating(
        settings.clone(),
        |review: Review<ClusterName, ConfigMap>| async move {
            match review.name.as_str() {
                "error" => Err("failed"),
                "deny" => Ok(Verdict::deny("no").warn("w")),
                _ => Ok(Verdict::allow()),
            }
        },
    );
    let mutating = review::mutating(
        settings,
        |review: Review<ClusterName, ConfigMap>| async move {
            let Some(mut object) = review.object else {
                return Ok(Mutation::unchanged());
            };
            if review.name == "error" {
                return Err("failed");
            }
            object
                .metadata
                .annotations
                .get_or_insert_default()
                .insert("a/b~c".into(), review.cluster.to_string());
            Ok(Mutation::changed(object))
        },
    );
    let request: Option<serde_json::Value> = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("request").cloned());
    let uid = request
        .as_ref()
        .and_then(|r| r.get("uid"))
        .and_then(|u| u.as_str())
        .map(str::to_string);
    for (handle, mutating) in [(validating, false), (mutating, true)] {
        let answer = handle(
            ClusterName::from(id.as_str()),
            bytes::Bytes::from(body.clone()),
        )
        .now_or_never()
        .expect("the handlers never wait");
        let review: serde_json::Value =
            serde_json::from_slice(&answer.body).expect("the answer is JSON");
        assert_eq!(review["apiVersion"], "admission.k8s.io/v1", "{review}");
        assert_eq!(review["kind"], "AdmissionReview", "{review}");
        let response = &review["response"];
        if let Some(uid) = &uid {
            assert_eq!(response["uid"].as_str(), Some(uid.as_str()), "{review}");
        }
        if response["allowed"] == false {
            let code = response["status"]["code"].as_u64().unwrap_or(0);
            assert!(code >= 400, "a denial without a code: {review}");
        }
        let patch = response.get("patch");
        if !mutating {
            assert!(
                patch.is_none(),
                "a validating answer with a patch: {review}"
            );
        } else if let Some(patch) = patch {
            let bytes: Vec<u8> = serde_json::from_value(patch.clone()).expect("bytes");
            let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
            let mut object = request
                .as_ref()
                .and_then(|r| r.get("object").cloned())
                .expect("a patch has an object to change");
            json_patch::patch(&mut object, &patch).expect("the patch applies to the object");
        }
    }
}

/// 9. Owner records across clusters ([`crate::ownership`]): any bytes read as an annotation
///    parse or are refused, never a panic, and a refusal never quotes them; an owner built
///    from any parts (cluster ids with any characters) survives its annotation, and its label
///    value is a valid label value, equal for every uid of the same name.
pub fn owner_records(data: &[u8]) {
    use crate::ownership::FleetOwner;
    if let Ok(text) = std::str::from_utf8(data) {
        match FleetOwner::<ClusterName>::parse(text) {
            Ok(owner) => {
                let again = FleetOwner::<ClusterName>::parse(&owner.annotation())
                    .expect("a parsed owner's annotation parses");
                assert_eq!(again, owner);
            }
            Err(error) => {
                let message = error.to_string();
                // Errors hold no double quote: a text with one cannot be in the fixed words.
                if text.contains('"') {
                    assert!(!message.contains(text), "{message:?} quotes the annotation");
                }
            }
        }
    }
    let [cluster, api_version, kind, namespace, name, uid, flag] =
        <[String; 7]>::try_from(fields(data, 7)).expect("7");
    let owner = FleetOwner {
        cluster: ClusterName::from(cluster),
        api_version,
        kind,
        namespace: (!flag.is_empty()).then_some(namespace),
        name,
        uid,
    };
    let label = owner.label_value();
    assert!(
        label.len() <= 63 && label.chars().all(|c| c.is_ascii_alphanumeric()),
        "{label:?} is not a label value"
    );
    let other = FleetOwner {
        uid: format!("{}x", owner.uid),
        ..owner.clone()
    };
    assert_eq!(other.label_value(), label);
    // What parses back is exactly the owner, and nothing that parses can change a request
    // path (its name, namespace, kind and apiVersion are what objects have); an owner the
    // parser refuses has a field it refuses.
    use crate::client::owners::{is_api_version, is_path_safe_name};
    let acceptable = |o: &FleetOwner<ClusterName>| {
        let plain = |f: &str, max: usize| {
            !f.is_empty() && f.len() <= max && !f.chars().any(char::is_control)
        };
        plain(&o.api_version, 317)
            && plain(&o.kind, 253)
            && plain(&o.name, 253)
            && plain(&o.uid, 128)
            && o.namespace.as_deref().is_none_or(|n| {
                plain(n, 63)
                    && n.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
            && is_api_version(&o.api_version)
            && o.kind.chars().all(|c| c.is_ascii_alphanumeric())
            && is_path_safe_name(&o.name)
    };
    match FleetOwner::<ClusterName>::parse(&owner.annotation()) {
        Ok(again) => {
            assert_eq!(again, owner);
            assert!(acceptable(&again), "{again:?} was accepted");
        }
        Err(error) => assert!(!acceptable(&owner), "{owner:?} refused: {error}"),
    }
}
