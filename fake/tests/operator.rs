//! The operator example's reconciler (copies of the host's labelled ConfigMaps in every
//! cluster, and a report on the original) under the schedule checker.

#[path = "../../examples/operator.rs"]
#[allow(dead_code)]
mod operator;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use multicluster_runtime::{ClusterName, Request};
use multicluster_runtime_fake::{Checker, World};
use operator::{COPIED_FROM, COPIED_TO, COPY_LABEL, FIELD_MANAGER, State};

fn original() -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("settings".into());
    cm.metadata.namespace = Some("mcr-system".into());
    cm.metadata.labels = Some(BTreeMap::from([(COPY_LABEL.into(), "true".into())]));
    cm.data = Some(BTreeMap::from([("level".into(), "info".into())]));
    cm
}

/// Every engaged member holds the copy; the original names exactly the engaged members.
fn copied(world: &World) -> Result<(), String> {
    let Some(original) = world.get::<ConfigMap>("host", Some("mcr-system"), "settings") else {
        return Err("the original is gone".into());
    };
    let mut members: Vec<&str> = world
        .clusters()
        .filter(|c| *c != "host" && world.is_engaged(c))
        .collect();
    members.sort();
    for member in &members {
        let copy: Option<ConfigMap> = world.get(member, Some("default"), "settings");
        if copy.as_ref().and_then(|c| c.data.as_ref()) != original.data.as_ref() {
            return Err(format!("{member}: the copy is {copy:?}"));
        }
    }
    let reported = original
        .annotations()
        .get(COPIED_TO)
        .cloned()
        .unwrap_or_default();
    if reported != members.join(",") {
        return Err(format!(
            "the original says copied-to {reported:?}, the members are {members:?}"
        ));
    }
    Ok(())
}

#[test]
fn the_operator_copies_into_every_member_and_reports_them_over_every_ordering_tried() {
    let host = ClusterName::from("host");
    let report = Checker::with_state(operator::reconcile, || State {
        target_namespace: None,
        resync: Duration::from_secs(300),
        shard: None,
    })
    .local("host", |b| b.namespace("mcr-system").object(&original()))
    .cluster("c1", |b| b)
    .cluster("c2", |b| b)
    .watched_in(|c| c == "host")
    .labels(&format!("{COPY_LABEL}=true"))
    .maps::<ConfigMap, _>(move |_, copy| {
        let managed = copy
            .labels()
            .get("app.kubernetes.io/managed-by")
            .is_some_and(|m| m == FIELD_MANAGER);
        let from = copy
            .annotations()
            .get(COPIED_FROM)
            .and_then(|f| f.split_once('/'));
        match (managed, from) {
            (true, Some((ns, name))) => vec![Request::new(host.clone(), Some(ns), name)],
            _ => Vec::new(),
        }
    })
    .reconcile_all_on_fleet_events()
    .invariant(copied)
    .budgets(1, 1, 1, 1)
    .random(200)
    .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(report.schedules, 200);
}
