//! Cancellation helpers shared by the tasks of a run.

use tokio_util::sync::CancellationToken;

/// A token cancelled when either `a` or `b` is.
pub(crate) fn until_either(a: CancellationToken, b: CancellationToken) -> CancellationToken {
    let either = a.child_token();
    let watcher = either.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = b.cancelled() => watcher.cancel(),
            () = watcher.cancelled() => {}
        }
    });
    either
}
