//! Faults a test turns on: failed answers, latency, a server that stops answering.

use std::time::Duration;

/// A verb of the API, as a fault selects requests by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Verb {
    /// Reading one object.
    Get,
    /// Listing objects.
    List,
    /// Opening a watch.
    Watch,
    /// Creating an object.
    Create,
    /// Replacing an object (PUT).
    Update,
    /// Patching an object (any patch type, server-side apply included).
    Patch,
    /// Deleting an object.
    Delete,
    /// Deleting a collection.
    DeleteCollection,
}

impl Verb {
    /// Whether this verb writes.
    pub fn writes(self) -> bool {
        matches!(
            self,
            Verb::Create | Verb::Update | Verb::Patch | Verb::Delete | Verb::DeleteCollection
        )
    }
}

/// Requests that answer with an error status instead of being served.
///
/// ```
/// use multicluster_runtime_fake::{Fault, Verb};
/// // The next two updates of ConfigMaps answer 409 Conflict.
/// let fault = Fault::on(Verb::Update).resource("configmaps").status(409).times(2);
/// # let _ = fault;
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct Fault {
    pub(crate) verbs: Vec<Verb>,
    pub(crate) resource: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) status: u16,
    pub(crate) times: Option<usize>,
}

impl Fault {
    /// Requests of `verb` (add more with [`Fault::or`]). Answers 500 every time until changed.
    pub fn on(verb: Verb) -> Self {
        Fault {
            verbs: vec![verb],
            resource: None,
            name: None,
            status: 500,
            times: None,
        }
    }

    /// Every write: create, update, patch, delete and delete-collection.
    pub fn writes() -> Self {
        Fault {
            verbs: vec![
                Verb::Create,
                Verb::Update,
                Verb::Patch,
                Verb::Delete,
                Verb::DeleteCollection,
            ],
            ..Fault::on(Verb::Create)
        }
    }

    /// Every request.
    pub fn any() -> Self {
        Fault {
            verbs: vec![
                Verb::Get,
                Verb::List,
                Verb::Watch,
                Verb::Create,
                Verb::Update,
                Verb::Patch,
                Verb::Delete,
                Verb::DeleteCollection,
            ],
            ..Fault::on(Verb::Get)
        }
    }

    /// Requests of `verb` too.
    pub fn or(mut self, verb: Verb) -> Self {
        self.verbs.push(verb);
        self
    }

    /// Only requests of this resource (its plural, as in the URL: `configmaps`).
    pub fn resource(mut self, plural: impl Into<String>) -> Self {
        self.resource = Some(plural.into());
        self
    }

    /// Only requests naming this object.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The status code to answer: 429 (with `Retry-After: 1`), 500, 503, 409, 403… The
    /// answer is a `Status` with the reason a real server gives for that code.
    pub fn status(mut self, code: u16) -> Self {
        self.status = code;
        self
    }

    /// Only the next `n` matching requests, then the fault is gone (`0`: none).
    pub fn times(mut self, n: usize) -> Self {
        self.times = Some(n);
        self
    }

    pub(crate) fn matches(&self, verb: Verb, resource: &str, name: Option<&str>) -> bool {
        self.verbs.contains(&verb)
            && self.resource.as_deref().is_none_or(|r| r == resource)
            && self.name.as_deref().is_none_or(|n| Some(n) == name)
    }
}

/// How the server answers at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum Answering {
    #[default]
    Yes,
    /// Requests wait (and watches deliver nothing) until the server answers again: a stopped
    /// process, a network partition.
    Hang,
    /// Requests fail as a refused connection does, and open watches end.
    Refuse,
}

/// The faults in force.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    pub(crate) rules: Vec<Fault>,
    pub(crate) latency: Duration,
}

impl Faults {
    /// The status a request answers with, if a fault takes it (counting the fault down).
    pub(crate) fn take(&mut self, verb: Verb, resource: &str, name: Option<&str>) -> Option<u16> {
        // A fault for zero more requests is spent: it takes none.
        self.rules.retain(|f| f.times != Some(0));
        let at = self
            .rules
            .iter()
            .position(|f| f.matches(verb, resource, name))?;
        let status = self.rules[at].status;
        if let Some(n) = &mut self.rules[at].times {
            *n = n.saturating_sub(1);
            if *n == 0 {
                let _ = self.rules.remove(at);
            }
        }
        Some(status)
    }
}
