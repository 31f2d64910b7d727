//! The example operator (examples/operator.rs) as a process, and the ConfigMap it copies
//! (tests/operator.rs, tests/cli.rs).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};

use super::audited::labelled_cm;
use super::{free_port, http_get_opt, sample};

/// One operator process: its endpoints' address and its log file.
pub struct OperatorProcess {
    pub child: tokio::process::Child,
    pub addr: std::net::SocketAddr,
    pub log: std::path::PathBuf,
}

impl OperatorProcess {
    pub fn start(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        dir: &std::path::Path,
    ) -> Self {
        Self::start_in(binary, kubeconfig, identity, "mcr-system", dir)
    }

    /// As [`OperatorProcess::start`], with the operator's namespace `namespace` (the copies'
    /// too), endpoints over plain HTTP.
    pub fn start_in(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        namespace: &str,
        dir: &std::path::Path,
    ) -> Self {
        let extra = ["--plain-http", "--resync-seconds", "2"];
        Self::spawn(binary, kubeconfig, identity, namespace, dir, &extra)
    }

    /// As `deploy/operator.yaml` runs it (HTTPS endpoints, tokens checked by the host),
    /// resyncing only every 600 s.
    pub fn as_deployed(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        dir: &std::path::Path,
    ) -> Self {
        let extra = ["--resync-seconds", "600"];
        Self::spawn(binary, kubeconfig, identity, "mcr-system", dir, &extra)
    }

    fn spawn(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        namespace: &str,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> Self {
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = dir.join(format!("{identity}.log"));
        let child = tokio::process::Command::new(binary)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--namespace", namespace, "--target-namespace", namespace])
            .args(["--identity", identity, "--log-format", "json"])
            .args([
                "--lease-duration-seconds",
                "4",
                "--renew-deadline-seconds",
                "2",
                "--retry-period-seconds",
                "0.5",
            ])
            .arg(format!("--bind-address={addr}"))
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::process::Stdio::inherit())
            // A failing test ends it.
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, addr, log }
    }

    /// Whether it reports leading, on /metrics.
    pub async fn leads(&self) -> bool {
        let Ok((200, text)) =
            tokio::time::timeout(Duration::from_secs(2), http_get_opt(self.addr, "/metrics"))
                .await
                .unwrap_or(Err(()))
        else {
            return false;
        };
        sample(
            &text,
            "leader_election_master_status",
            &[("name", "mcr-system/mcr-operator")],
        ) == Some(1.0)
    }
}

/// The ConfigMap `mcr-system/settings` of the host, labelled to be copied, `colour: blue`.
pub async fn create_original(host: &kube::Client) {
    let mut original = labelled_cm("settings", &[("mcr.example.io/copy", "true")]);
    original.data = Some(BTreeMap::from([("colour".into(), "blue".into())]));
    Api::<ConfigMap>::namespaced(host.clone(), "mcr-system")
        .create(&PostParams::default(), &original)
        .await
        .unwrap();
}

pub async fn configmap_in(client: &kube::Client, ns: &str, name: &str) -> Option<ConfigMap> {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
}
