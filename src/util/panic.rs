//! The text of a caught panic, for logs and errors.

/// The text of a panic's payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// The text of a task's end: its panic's, or the join error's.
pub(crate) fn join_error_text(error: tokio::task::JoinError) -> String {
    match error.try_into_panic() {
        Ok(panic) => panic_message(&*panic),
        Err(error) => error.to_string(),
    }
}
