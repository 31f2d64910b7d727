//! Exec credential plugins, run by the crate itself.
//!
//! kube-client runs a plugin with `std::process::Command::output()`: synchronously, with no
//! time limit, on whatever thread asks (a runtime worker, on a token refresh). A plugin that
//! hangs (an identity provider behind a black hole) then holds that thread for as long, and
//! a caller that gives up leaves the process running. Here a plugin runs as a child process
//! the runtime waits on without a thread, in a process group of its own, for at most a
//! deadline; a run that is given up on (the deadline, or its caller dropped) kills the whole
//! group, the plugin's own children included.

use std::time::{Duration, SystemTime};

use kube::config::{ExecConfig, ExecInteractiveMode};
use secrecy::SecretString;
use serde::Deserialize;
use tokio::io::AsyncReadExt;

/// How long a plugin may take before it is killed, with its children.
const TIMEOUT: Duration = Duration::from_secs(30);
/// The most a plugin may print (an ExecCredential is a few KiB).
const MAX_OUTPUT: u64 = 1 << 20;

/// How long an exec credential plugin may run before it is killed (30 s).
pub(crate) fn timeout() -> Duration {
    TIMEOUT
}

/// What a plugin answered.
pub(crate) struct Credential {
    pub(crate) token: Option<SecretString>,
    /// A client certificate chain and its key, in PEM.
    pub(crate) certificate: Option<(String, SecretString)>,
    pub(crate) expires: Option<SystemTime>,
}

#[derive(Deserialize)]
struct Answer {
    #[serde(rename = "apiVersion")]
    api_version: Option<String>,
    status: Option<Status>,
}

#[derive(Deserialize)]
struct Status {
    #[serde(rename = "expirationTimestamp")]
    expiration_timestamp: Option<String>,
    token: Option<String>,
    #[serde(rename = "clientCertificateData")]
    client_certificate_data: Option<String>,
    #[serde(rename = "clientKeyData")]
    client_key_data: Option<String>,
}

/// The process group of a running plugin: killed when dropped, unless it was waited for.
struct Group {
    child: tokio::process::Child,
    /// Its id, while the group may still have members to kill.
    id: Option<i32>,
}

impl Group {
    fn kill(&mut self) {
        #[cfg(unix)]
        if let Some(id) = self.id.take() {
            // The leader's id is the group's: every process the plugin started goes too.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(id),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        #[cfg(not(unix))]
        let _ = self.child.start_kill();
    }

    /// Kills the group and waits (briefly) for the leader to be gone.
    async fn end(mut self) {
        self.kill();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.child.wait()).await;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // A run given up on: the caller dropped it mid-way. (The runtime reaps the leader.)
        self.kill();
    }
}

/// Runs `exec` once, for at most `limit`. The error says what failed in words that hold
/// nothing of the plugin's command line, environment or output.
pub(crate) async fn run(exec: &ExecConfig, limit: Duration) -> Result<Credential, String> {
    let command = exec
        .command
        .as_deref()
        .filter(|c| !c.is_empty())
        .ok_or("the exec credential plugin has no command")?;
    if exec.interactive_mode == Some(ExecInteractiveMode::Always) {
        return Err("the exec credential plugin needs a terminal (interactiveMode: Always), which a controller does not have".into());
    }
    let mut cmd = tokio::process::Command::new(command);
    cmd.args(exec.args.iter().flatten());
    for variable in exec.env.iter().flatten() {
        if let (Some(name), Some(value)) = (variable.get("name"), variable.get("value")) {
            cmd.env(name, value);
        }
    }
    let mut spec = serde_json::json!({ "interactive": false });
    if exec.provide_cluster_info {
        let cluster = exec
            .cluster
            .as_ref()
            .ok_or("the exec credential plugin asks for cluster info, which the cluster lacks")?;
        spec["cluster"] = serde_json::to_value(cluster)
            .map_err(|_| "the exec credential plugin's input cannot be written")?;
    }
    let info = serde_json::json!({
        "apiVersion": exec.api_version,
        "kind": "ExecCredential",
        "spec": spec,
    });
    cmd.env("KUBERNETES_EXEC_INFO", info.to_string());
    for name in exec.drop_env.iter().flatten() {
        cmd.env_remove(name);
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        // What a plugin says on stderr is never shown (it may hold credentials).
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    #[cfg(unix)]
    cmd.process_group(0);
    let mut child = cmd.spawn().map_err(|e| {
        format!(
            "the exec credential plugin cannot be started ({})",
            e.kind()
        )
    })?;
    let stdout = child.stdout.take();
    let id = child.id().and_then(|id| i32::try_from(id).ok());
    let mut group = Group { child, id };
    let ran = tokio::time::timeout(limit, async {
        let mut out = Vec::new();
        if let Some(stdout) = stdout {
            stdout
                .take(MAX_OUTPUT + 1)
                .read_to_end(&mut out)
                .await
                .map_err(|e| {
                    format!(
                        "the exec credential plugin's output cannot be read ({})",
                        e.kind()
                    )
                })?;
        }
        if out.len() as u64 > MAX_OUTPUT {
            return Err(format!(
                "the exec credential plugin printed more than {} KiB",
                MAX_OUTPUT / 1024
            ));
        }
        let status = group.child.wait().await.map_err(|e| {
            format!(
                "the exec credential plugin cannot be waited for ({})",
                e.kind()
            )
        })?;
        Ok((out, status))
    })
    .await;
    let (out, status) = match ran {
        Ok(Ok(ran)) => ran,
        Ok(Err(error)) => {
            group.end().await;
            return Err(error);
        }
        Err(_) => {
            group.end().await;
            return Err(format!(
                "the exec credential plugin did not answer within {} s; it was stopped",
                limit.as_secs_f64()
            ));
        }
    };
    // The leader is gone; what it left running stays (as with client-go).
    group.id = None;
    if !status.success() {
        return Err(match status.code() {
            Some(code) => format!("the exec credential plugin exited with status {code}"),
            None => "the exec credential plugin was killed by a signal".into(),
        });
    }
    parse(&out, exec.api_version.as_deref())
}

/// The credential in a plugin's output (JSON, or YAML as client-go also reads).
fn parse(out: &[u8], asked: Option<&str>) -> Result<Credential, String> {
    const UNUSABLE: &str = "the exec credential plugin's output is not a usable ExecCredential";
    let answer: Answer = serde_saphyr::from_slice(out).map_err(|_| UNUSABLE.to_string())?;
    if let (Some(asked), Some(answered)) = (asked, answer.api_version.as_deref())
        && asked != answered
    {
        // What it answered is its output: not quoted.
        return Err(format!(
            "the exec credential plugin answered in another version than asked ({asked})"
        ));
    }
    let status = answer
        .status
        .ok_or("the exec credential plugin returned no status")?;
    let expires = match status.expiration_timestamp.as_deref() {
        None => None,
        Some(at) => Some(SystemTime::from(
            at.parse::<k8s_openapi::jiff::Timestamp>().map_err(|_| {
                "the exec credential plugin returned a malformed expiration time".to_string()
            })?,
        )),
    };
    let certificate = match (status.client_certificate_data, status.client_key_data) {
        (Some(cert), Some(key)) => Some((cert, SecretString::from(key))),
        (None, None) => None,
        _ => {
            return Err(
                "the exec credential plugin returned a client certificate without its key, or a key without its certificate"
                    .into(),
            );
        }
    };
    let token = status
        .token
        .filter(|t| !t.is_empty())
        .map(SecretString::from);
    if token.is_none() && certificate.is_none() {
        return Err(
            "the exec credential plugin returned neither a token nor a client certificate".into(),
        );
    }
    Ok(Credential {
        token,
        certificate,
        expires,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    fn plugin(script: &str) -> ExecConfig {
        ExecConfig {
            api_version: Some("client.authentication.k8s.io/v1".into()),
            command: Some("sh".into()),
            args: Some(vec!["-c".into(), script.into()]),
            env: Some(vec![std::collections::HashMap::from([
                ("name".to_string(), "WHO".to_string()),
                ("value".to_string(), "tester".to_string()),
            ])]),
            drop_env: None,
            install_hint: None,
            provide_cluster_info: false,
            cluster: None,
            interactive_mode: Some(ExecInteractiveMode::Never),
            other: Default::default(),
        }
    }

    #[tokio::test]
    async fn a_plugins_token_certificate_and_expiry_are_read_from_json_or_yaml() {
        let answer = plugin(
            r#"printf '{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"t-%s","expirationTimestamp":"2030-01-01T00:00:00Z"}}' "$WHO""#,
        );
        let credential = run(&answer, Duration::from_secs(10)).await.unwrap();
        assert_eq!(credential.token.unwrap().expose_secret(), "t-tester");
        assert_eq!(
            credential.expires,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_893_456_000))
        );
        let yaml = plugin(
            "printf 'apiVersion: client.authentication.k8s.io/v1\\nkind: ExecCredential\\nstatus:\\n  clientCertificateData: C\\n  clientKeyData: K\\n'",
        );
        let credential = run(&yaml, Duration::from_secs(10)).await.unwrap();
        let (cert, key) = credential.certificate.unwrap();
        assert_eq!((cert.as_str(), key.expose_secret()), ("C", "K"));
        assert!(credential.token.is_none() && credential.expires.is_none());
    }

    #[tokio::test]
    async fn what_a_plugin_gets_wrong_is_said_without_its_output() {
        for (script, said) in [
            ("echo SECRET; exit 3", "exited with status 3"),
            ("echo SECRET-not-json", "not a usable ExecCredential"),
            (
                r#"echo '{"apiVersion":"client.authentication.k8s.io/v1beta1","status":{"token":"SECRET"}}'"#,
                "another version than asked",
            ),
            (
                r#"echo '{"apiVersion":"client.authentication.k8s.io/v1","status":{"token":"SECRET","expirationTimestamp":"SECRET"}}'"#,
                "malformed expiration time",
            ),
            (
                r#"echo '{"apiVersion":"client.authentication.k8s.io/v1","status":{"clientCertificateData":"SECRET"}}'"#,
                "without its key",
            ),
            ("head -c 2000000 /dev/zero", "more than 1024 KiB"),
        ] {
            let error = run(&plugin(script), Duration::from_secs(10))
                .await
                .err()
                .unwrap_or_else(|| panic!("{script}: refused"));
            assert!(error.contains(said), "{script}: {error}");
            assert!(!error.contains("SECRET"), "{script}: {error}");
        }
        let mut terminal = plugin("true");
        terminal.interactive_mode = Some(ExecInteractiveMode::Always);
        assert!(
            run(&terminal, Duration::from_secs(10))
                .await
                .err()
                .unwrap()
                .contains("needs a terminal")
        );
    }

    #[tokio::test]
    async fn a_plugin_past_its_deadline_is_stopped_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dir.path().join("child");
        let hangs = plugin(&format!("sleep 3600 & echo $! > '{}'; wait", pid.display()));
        let started = tokio::time::Instant::now();
        let error = run(&hangs, Duration::from_millis(500)).await.err().unwrap();
        assert!(error.contains("did not answer within 0.5 s"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let child: i32 = std::fs::read_to_string(&pid)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // The plugin's own child was killed with it (it is not ours to reap: wait until it
        // is gone or a zombie).
        let gone = || {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .map(|s| {
                    s.rsplit_once(')')
                        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
                })
                .unwrap_or(true)
        };
        for _ in 0..100 {
            if gone() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the plugin's child {child} still runs");
    }
}
