//! Who may read what the endpoints serve: a bearer token checked with the host's
//! TokenReview, then the request (a non-resource URL and a verb) with its
//! SubjectAccessReview, as the kube-apiserver itself and controller-runtime's secure metrics
//! do. Answers are cached for a short while, so a scrape every few seconds costs the host
//! two requests a minute, not two a scrape.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenReview;
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use tokio::time::Instant;

use crate::util::sync::lock;

/// How long an answer stands: an allowed request, a denied one (a role being granted is seen
/// sooner), and the most answers kept (oldest dropped first).
const ALLOWED_FOR: Duration = Duration::from_secs(60);
const DENIED_FOR: Duration = Duration::from_secs(10);
const KEPT: usize = 1024;
/// Reviews asked of the host at once: a flood of made-up tokens waits here instead of
/// flooding the host (or the client's rate limit, which the controllers share).
const REVIEWS_AT_ONCE: usize = 4;
/// How long a request waits for its token's review (its turn and the host's answers): a
/// host that does not answer costs a client `503` after this, not a connection held open.
pub(crate) const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// The outcome of a request's check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum AuthVerdict {
    /// Authenticated and authorized.
    Allowed,
    /// No token, or the host does not know it: `401`.
    Unauthenticated,
    /// Authenticated, not authorized: `403`.
    Forbidden,
    /// The host could not be asked: `503` (not cached).
    Unavailable,
}

/// What was asked: a token, a path and a verb.
type Question = (String, String, String);

/// Checks tokens against a host cluster, with a cache.
pub(crate) struct Authorizer {
    client: kube::Client,
    /// Answers by question, with when they were given.
    cache: Mutex<HashMap<Question, (AuthVerdict, Instant)>>,
    reviews: tokio::sync::Semaphore,
}

impl Authorizer {
    pub(crate) fn new(client: kube::Client) -> Arc<Self> {
        Arc::new(Self {
            client,
            cache: Mutex::new(HashMap::new()),
            reviews: tokio::sync::Semaphore::new(REVIEWS_AT_ONCE),
        })
    }

    /// Whether the bearer of `token` may `verb` the non-resource URL `path`; unavailable if
    /// the host has not said within [`REVIEW_TIMEOUT`].
    pub(crate) async fn check(&self, token: Option<&str>, path: &str, verb: &str) -> AuthVerdict {
        tokio::time::timeout(REVIEW_TIMEOUT, self.check_now(token, path, verb))
            .await
            .unwrap_or(AuthVerdict::Unavailable)
    }

    async fn check_now(&self, token: Option<&str>, path: &str, verb: &str) -> AuthVerdict {
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            return AuthVerdict::Unauthenticated;
        };
        let key = (token.to_string(), path.to_string(), verb.to_string());
        let cached = || {
            lock(&self.cache)
                .get(&key)
                .filter(|(verdict, at)| at.elapsed() < ttl(verdict))
                .map(|(verdict, _)| verdict.clone())
        };
        if let Some(verdict) = cached() {
            return verdict;
        }
        let Ok(_permit) = self.reviews.acquire().await else {
            return AuthVerdict::Unavailable;
        };
        // Answered while this one waited its turn.
        if let Some(verdict) = cached() {
            return verdict;
        }
        let verdict = self.ask(token, path, verb).await;
        if verdict != AuthVerdict::Unavailable {
            let mut cache = lock(&self.cache);
            if cache.len() >= KEPT {
                cache.retain(|_, (verdict, at)| at.elapsed() < ttl(verdict));
            }
            if cache.len() >= KEPT {
                // Still full of live answers (made-up tokens): the oldest quarter goes.
                let mut ages: Vec<_> = cache.iter().map(|(k, (_, at))| (*at, k.clone())).collect();
                ages.sort_unstable_by_key(|(at, _)| *at);
                for (_, old) in ages.into_iter().take(KEPT / 4) {
                    cache.remove(&old);
                }
            }
            cache.insert(key, (verdict.clone(), Instant::now()));
        }
        verdict
    }

    async fn ask(&self, token: &str, path: &str, verb: &str) -> AuthVerdict {
        // Through its JSON form: the type of `spec.token` differs between the Kubernetes
        // versions a user's k8s-openapi may pick.
        let review = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        });
        let Ok(review) = serde_json::from_value::<TokenReview>(review) else {
            return AuthVerdict::Unavailable;
        };
        let reviews: Api<TokenReview> = Api::all(self.client.clone());
        let user = match reviews.create(&PostParams::default(), &review).await {
            Ok(answer) => match answer.status {
                Some(status) if status.authenticated == Some(true) => {
                    status.user.unwrap_or_default()
                }
                _ => return AuthVerdict::Unauthenticated,
            },
            Err(error) => {
                // The token is never logged; the host's error says nothing of it.
                tracing::warn!(error = %crate::client::Shown(&error), "endpoints: the host's TokenReview failed");
                return AuthVerdict::Unavailable;
            }
        };
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.to_string()),
                    verb: Some(verb.to_string()),
                }),
                resource_attributes: None,
            },
            ..Default::default()
        };
        let accesses: Api<SubjectAccessReview> = Api::all(self.client.clone());
        match accesses.create(&PostParams::default(), &access).await {
            Ok(answer) if answer.status.as_ref().is_some_and(|s| s.allowed) => AuthVerdict::Allowed,
            Ok(_) => AuthVerdict::Forbidden,
            Err(error) => {
                tracing::warn!(error = %crate::client::Shown(&error), "endpoints: the host's SubjectAccessReview failed");
                AuthVerdict::Unavailable
            }
        }
    }
}

/// How long `verdict` stands in the cache.
fn ttl(verdict: &AuthVerdict) -> Duration {
    if *verdict == AuthVerdict::Allowed {
        ALLOWED_FOR
    } else {
        DENIED_FOR
    }
}
