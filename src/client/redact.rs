//! Errors of credentials, made safe to show: kube-client's authentication errors carry an
//! exec plugin's command line (arguments and every variable set for it, the cluster's
//! `KUBERNETES_EXEC_INFO` among them) and what the plugin printed.
//!
//! Such text must not reach a log line, an Event (readable by anyone with `view` on a
//! namespace), `/readyz?verbose`, `cache_status` or a metric. Every cluster's client (built
//! by the crate, or given to [`Cluster::new`](crate::Cluster::new)) has its errors passed
//! through [`redact_boxed`] on their way out (the cluster's own tower layer, outermost on
//! every path); errors of a client's construction through [`redact_kube`]. [`safe_text`] is
//! the filter for error text the crate keeps, and [`Shown`] for the log lines of errors of
//! plain `kube::Client`s given for the host (leader election, sharding, hub providers, the
//! endpoints' token checks), which the crate does not wrap.

use std::error::Error as StdError;
use std::fmt;

use kube::client::AuthError;

type BoxError = Box<dyn StdError + Send + Sync>;

/// A failure of a cluster's credentials (most often its exec credential plugin), described
/// without the plugin's command line, environment or output.
///
/// Requests whose credentials could not be made fail with this error inside
/// [`kube::Error::Service`]; so does [`Cluster::from_config`](crate::Cluster::from_config)
/// when its plugin fails. kube-client's own [`AuthError`] takes its place wherever its text
/// could carry a secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CredentialError {
    description: String,
}

impl CredentialError {
    /// A failure described by `description`, which must hold nothing of the credentials.
    pub(crate) fn new(description: impl Into<String>) -> Self {
        Self {
            description: description.into(),
        }
    }

    /// What failed, in words that hold nothing of the credentials.
    pub fn description(&self) -> &str {
        &self.description
    }
}

impl fmt::Display for CredentialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.description)
    }
}

impl StdError for CredentialError {}

/// Whether kube's text of `error` is known to hold nothing of the credentials: the
/// variants that quote no input, a command or a plugin's output.
fn is_safe(error: &AuthError) -> bool {
    matches!(
        error,
        AuthError::InvalidBasicAuth(_)
            | AuthError::InvalidBearerToken(_)
            | AuthError::UnrefreshableTokenResponse
            | AuthError::ExecPluginFailed
            | AuthError::AuthExecStart(_)
            | AuthError::ReadTokenFile(..)
            | AuthError::MissingCommand
            | AuthError::ExecMissingClusterInfo
            | AuthError::NoValidNativeRootCA(_)
    )
}

/// What failed, in fixed words: no command line, environment, output or input.
pub(crate) fn describe_auth(error: &AuthError) -> String {
    use AuthError as A;
    match error {
        A::InvalidBasicAuth(_) => "the username and password cannot form an HTTP header".into(),
        A::InvalidBearerToken(_) => "the token cannot form an HTTP header".into(),
        A::UnrefreshableTokenResponse => {
            "the credential plugin returned a token that cannot be refreshed".into()
        }
        A::ExecPluginFailed => "the exec credential plugin returned no status".into(),
        A::MalformedTokenExpirationDate(_) => {
            "the exec credential plugin returned a malformed expiration time".into()
        }
        A::AuthExecStart(e) => {
            format!(
                "the exec credential plugin cannot be started ({})",
                e.kind()
            )
        }
        A::AuthExecRun { out, .. } => match out.status.code() {
            Some(code) => format!("the exec credential plugin exited with status {code}"),
            None => "the exec credential plugin was killed by a signal".into(),
        },
        A::AuthExecParse(_) | A::AuthExec(_) => {
            "the exec credential plugin's output is not a usable ExecCredential".into()
        }
        A::AuthExecSerialize(_) => "the exec credential plugin's input cannot be written".into(),
        A::ReadTokenFile(e, _) => {
            format!("tokenFile: cannot read the file it names ({})", e.kind())
        }
        A::ParseTokenKey(_) => "the token key is not valid".into(),
        A::MissingCommand => "the exec credential plugin has no command".into(),
        A::ExecMissingClusterInfo => {
            "the exec credential plugin asks for cluster info, which the cluster lacks".into()
        }
        A::NoValidNativeRootCA(_) => "no usable root certificates on this machine".into(),
        // Variants behind kube features this crate does not enable (another crate in the
        // build may): OAuth and OIDC, whose errors quote their providers' answers.
        #[allow(unreachable_patterns)]
        _ => "the credentials cannot be used".into(),
    }
}

/// Why a client could not be built from a valid configuration, without the credential
/// plugin's output or command line.
pub(crate) fn describe_client(error: &kube::Error) -> String {
    match error {
        kube::Error::Auth(auth) => describe_auth(auth),
        kube::Error::RustlsTls(tls) => {
            use kube::client::RustlsTlsError as T;
            match tls {
                T::InvalidIdentityPem(_) => "the client certificate and key are not valid PEM",
                T::MissingPrivateKey => "no client key (it must be PKCS8 or RSA/PKCS1)",
                T::MissingCertificate => "no client certificate",
                T::InvalidPrivateKey(_) => "the client key is not valid",
                T::UnknownPrivateKeyFormat => "the client key's format is unknown",
                T::AddRootCertificate(_) => "the certificate-authority certificate is not valid",
                T::NoValidNativeRootCA(_) => "no usable root certificates on this machine",
                T::InvalidServerName(_) => {
                    "the server's host or tls-server-name is not a valid name"
                }
            }
            .into()
        }
        kube::Error::TlsRequired => "the server is https, and no TLS stack is built in".into(),
        kube::Error::ProxyProtocolUnsupported { .. }
        | kube::Error::ProxyProtocolDisabled { .. } => {
            "the proxy-url's protocol is not supported".into()
        }
        kube::Error::Service(inner) => match find_unsafe(inner.as_ref()) {
            Some(auth) => describe_auth(auth),
            None => match inner.downcast_ref::<CredentialError>() {
                Some(credential) => credential.description.clone(),
                None => "the client cannot be built".into(),
            },
        },
        _ => "the client cannot be built".into(),
    }
}

/// The first authentication error in `error`'s chain (itself included) whose text may hold
/// credentials.
fn find_unsafe<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a AuthError> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(auth) = error.downcast_ref::<AuthError>()
            && !is_safe(auth)
        {
            return Some(auth);
        }
        if let Some(kube::Error::Auth(auth)) = error.downcast_ref::<kube::Error>()
            && !is_safe(auth)
        {
            return Some(auth);
        }
        next = error.source();
    }
    None
}

/// `error` as it may leave a client: an authentication error whose text could hold
/// credentials (found in its chain) becomes a [`CredentialError`]; anything else is
/// unchanged.
pub(crate) fn redact_boxed(error: BoxError) -> BoxError {
    match find_unsafe(error.as_ref()) {
        Some(auth) => Box::new(CredentialError {
            description: describe_auth(auth),
        }),
        None => error,
    }
}

/// A [`kube::Error`] of a client's construction, with an authentication error whose text
/// could hold credentials replaced by a [`CredentialError`] (in [`kube::Error::Service`]).
pub(crate) fn redact_kube(error: kube::Error) -> kube::Error {
    let description = match &error {
        kube::Error::Auth(auth) if !is_safe(auth) => describe_auth(auth),
        kube::Error::Service(inner) => match find_unsafe(inner.as_ref()) {
            Some(auth) => describe_auth(auth),
            None => return error,
        },
        _ => return error,
    };
    kube::Error::Service(Box::new(CredentialError { description }))
}

/// The text of `error` (its `Display`), with the text of any authentication error in its
/// chain that could hold credentials put in fixed words instead. For text the crate keeps
/// and shows (watch failures in `cache_status`, `/readyz?verbose` and logs), behind the
/// redaction on the clients' way out.
pub(crate) fn safe_text(error: &(dyn StdError + 'static)) -> String {
    let text = error.to_string();
    let Some(auth) = find_unsafe(error) else {
        return text;
    };
    let description = describe_auth(auth);
    // secrets-lint: the texts to take out, not shown.
    let (shown, debug) = (auth.to_string(), format!("{auth:?}"));
    if text.contains(&shown) || text.contains(&debug) {
        text.replace(&shown, &description)
            .replace(&debug, &description)
    } else {
        // The wrapper shows its cause in some other way: say only what failed.
        description
    }
}

/// An error shown as [`safe_text`] shows it: for the log lines of errors that come from
/// clients the crate did not build (a host `kube::Client` given by the user: its
/// authentication errors are kube's, with the plugin's command line and output).
pub(crate) struct Shown<'a>(pub(crate) &'a (dyn StdError + 'static));

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&safe_text(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kube's error of a failed plugin run: its text has the command line and the output.
    fn failed_run() -> AuthError {
        use std::os::unix::process::ExitStatusExt;
        AuthError::AuthExecRun {
            cmd: "SECRET_ENV=\"SECRET-ENV\" \"plugin\" \"SECRET-ARG\"".into(),
            out: Box::new(std::process::Output {
                status: std::process::ExitStatus::from_raw(3 << 8),
                stdout: b"SECRET-STDOUT".to_vec(),
                stderr: b"SECRET-STDERR".to_vec(),
            }),
        }
    }

    #[test]
    fn an_auth_error_in_a_service_error_leaves_a_client_in_fixed_words() {
        let boxed = redact_boxed(Box::new(failed_run()));
        assert_eq!(
            boxed.to_string(),
            "the exec credential plugin exited with status 3"
        );
        assert!(boxed.downcast_ref::<CredentialError>().is_some());
        // Also wrapped in a kube::Error (a client given by the user, seen through another).
        let wrapped = redact_boxed(Box::new(kube::Error::Service(Box::new(failed_run()))));
        assert!(
            !format!("{wrapped} {wrapped:?}").contains("SECRET"),
            "{wrapped:?}"
        );
        // Errors that are not about credentials pass as they are.
        let other = redact_boxed("connection refused".into());
        assert_eq!(other.to_string(), "connection refused");
        let safe = redact_boxed(Box::new(AuthError::MissingCommand));
        assert!(safe.downcast_ref::<AuthError>().is_some());
    }

    #[test]
    fn a_construction_error_of_a_failed_plugin_is_a_credential_error() {
        let error = redact_kube(kube::Error::Auth(failed_run()));
        assert!(
            !format!("{error} {error:?}").contains("SECRET"),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("exited with status 3"),
            "{error}"
        );
        assert_eq!(
            describe_client(&error),
            "the exec credential plugin exited with status 3"
        );
        let tls = redact_kube(kube::Error::TlsRequired);
        assert!(matches!(tls, kube::Error::TlsRequired));
    }

    #[test]
    fn kept_text_of_a_watch_failure_is_filtered_whatever_wraps_it() {
        let watch = kube_runtime::watcher::Error::InitialListFailed(kube::Error::Service(
            Box::new(failed_run()),
        ));
        let text = safe_text(&watch);
        assert!(!text.contains("SECRET"), "{text}");
        assert!(
            text.starts_with("failed to perform initial object list")
                && text.contains("exited with status 3"),
            "{text}"
        );
        let plain = kube_runtime::watcher::Error::InitialListFailed(kube::Error::TlsRequired);
        assert_eq!(safe_text(&plain), plain.to_string());
    }
}
