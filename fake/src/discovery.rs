//! Discovery: `/version`, `/api`, `/apis` and each group version's resource list, legacy and
//! aggregated (`apidiscovery.k8s.io/v2`), for the kinds the server serves.

use serde_json::{Value, json};

use crate::kinds::{Registry, Resource};

const VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

pub(crate) fn version() -> Value {
    json!({
        "major": "1",
        "minor": "36",
        "gitVersion": "v1.36.3-fake",
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "",
        "compiler": "fake",
        "platform": "linux/amd64"
    })
}

fn served(registry: &Registry) -> impl Iterator<Item = &Resource> {
    registry
        .iter()
        .map(|(_, r)| r)
        .filter(|r| !r.versions.is_empty())
}

/// The groups (other than the core group) and their versions, in the order first served.
fn groups(registry: &Registry) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for r in served(registry).filter(|r| !r.group.is_empty()) {
        let at = match groups.iter().position(|(g, _)| *g == r.group) {
            Some(i) => i,
            None => {
                groups.push((r.group.clone(), Vec::new()));
                groups.len() - 1
            }
        };
        for v in &r.versions {
            if !groups[at].1.contains(v) {
                groups[at].1.push(v.clone());
            }
        }
    }
    groups
}

pub(crate) fn core_versions() -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "fake:443"}]})
}

pub(crate) fn group_list(registry: &Registry) -> Value {
    let groups: Vec<Value> = groups(registry)
        .into_iter()
        .map(|(name, versions)| {
            let vs: Vec<Value> = versions
                .iter()
                .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
                .collect();
            json!({"name": name, "versions": vs, "preferredVersion": vs[0]})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/api/v1` or `/apis/{group}/{version}`; `None` when the group version is not served.
pub(crate) fn resource_list(registry: &Registry, group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in
        served(registry).filter(|r| r.group == group && r.versions.iter().any(|v| v == version))
    {
        resources.push(json!({
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": VERBS,
        }));
        if r.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", r.plural),
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    let group_version = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}),
    )
}

/// The aggregated discovery document of `/api` (`core`) or `/apis`.
pub(crate) fn aggregated(registry: &Registry, core: bool) -> Value {
    let names: Vec<(String, Vec<String>)> = if core {
        vec![(String::new(), vec!["v1".to_owned()])]
    } else {
        groups(registry)
    };
    let items: Vec<Value> = names
        .into_iter()
        .map(|(group, versions)| {
            let versions: Vec<Value> = versions
                .iter()
                .map(|version| {
                    let resources: Vec<Value> = served(registry)
                        .filter(|r| r.group == group && r.versions.contains(version))
                        .map(|r| {
                            let kind = json!({"group": group, "version": version, "kind": r.kind});
                            let subresources: Vec<Value> = if r.status_subresource {
                                vec![json!({"subresource": "status", "responseKind": kind, "verbs": ["get", "patch", "update"]})]
                            } else {
                                Vec::new()
                            };
                            json!({
                                "resource": r.plural,
                                "responseKind": kind,
                                "scope": if r.namespaced { "Namespaced" } else { "Cluster" },
                                "singularResource": r.singular,
                                "verbs": VERBS,
                                "subresources": subresources,
                            })
                        })
                        .collect();
                    json!({"version": version, "resources": resources, "freshness": "Current"})
                })
                .collect();
            json!({"metadata": {"name": group}, "versions": versions})
        })
        .collect();
    json!({"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": items})
}
