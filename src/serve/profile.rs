//! `/debug/pprof/profile` ([`Endpoints::profiling`](super::Endpoints::profiling)): a CPU
//! profile of the process, sampled for the seconds asked, in the pprof format (`go tool
//! pprof`, and the viewers that read it). Served behind the endpoints' authentication, like
//! any handler; one profile at a time (the profiler is the process's: `SIGPROF`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hyper::{Request, Response, StatusCode};

/// The path, as Go's `net/http/pprof` serves it.
pub(crate) const PATH: &str = "/debug/pprof/profile";
/// Seconds sampled when the request does not say (Go's default).
const DEFAULT_SECONDS: u64 = 30;
/// The longest profile served.
const MAX_SECONDS: u64 = 300;
/// Samples per second (Go's rate is 100; an odd rate does not beat with periodic work).
const FREQUENCY: i32 = 99;

/// Whether a profile is being taken.
static TAKING: AtomicBool = AtomicBool::new(false);

/// Clears [`TAKING`] when the profile ends, however it ends (a client gone drops it).
struct Taking;

impl Drop for Taking {
    fn drop(&mut self) {
        TAKING.store(false, Ordering::Release);
    }
}

fn plain(status: StatusCode, text: &str) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(text.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The seconds of `?seconds=N` (1 to [`MAX_SECONDS`]), else the default; an error for
/// anything else.
fn seconds(query: Option<&str>) -> Result<u64, String> {
    let Some(value) = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|p| p.strip_prefix("seconds="))
    else {
        return Ok(DEFAULT_SECONDS);
    };
    match value.parse::<u64>() {
        Ok(n) if (1..=MAX_SECONDS).contains(&n) => Ok(n),
        _ => Err(format!(
            "seconds must be a whole number from 1 to {MAX_SECONDS}\n"
        )),
    }
}

/// Samples the process for the seconds asked and answers the profile.
pub(crate) async fn cpu(request: Request<Bytes>) -> Response<Bytes> {
    if request.method() != hyper::Method::GET {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
    }
    let seconds = match seconds(request.uri().query()) {
        Ok(seconds) => seconds,
        Err(reason) => return plain(StatusCode::BAD_REQUEST, &reason),
    };
    if TAKING
        .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return plain(
            StatusCode::CONFLICT,
            "a profile is being taken: ask again when it is done\n",
        );
    }
    let taking = Taking;
    let guard = match pprof::ProfilerGuardBuilder::default()
        .frequency(FREQUENCY)
        .blocklist(&["libc", "libgcc", "pthread", "vdso"])
        .build()
    {
        Ok(guard) => guard,
        Err(error) => {
            tracing::warn!(%error, "could not start the CPU profiler");
            return plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the CPU profiler could not start\n",
            );
        }
    };
    tracing::info!(seconds, "taking a CPU profile");
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    // Symbolizing reads the binary's symbols: off the async workers.
    let encoded = tokio::task::spawn_blocking(move || {
        use pprof::protos::Message as _;
        let profile = guard.report().build()?.pprof()?;
        drop(guard);
        Ok::<_, pprof::Error>(profile.encode_to_vec())
    })
    .await;
    drop(taking);
    match encoded {
        Ok(Ok(bytes)) => {
            let mut response = Response::new(Bytes::from(bytes));
            let headers = response.headers_mut();
            headers.insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/octet-stream"),
            );
            headers.insert(
                hyper::header::CONTENT_DISPOSITION,
                hyper::header::HeaderValue::from_static("attachment; filename=\"profile\""),
            );
            response
        }
        Ok(Err(error)) => {
            tracing::warn!(%error, "could not build the CPU profile");
            plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the CPU profile could not be built\n",
            )
        }
        Err(_) => plain(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the CPU profile could not be built\n",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_asked_within_bounds() {
        assert_eq!(seconds(None), Ok(30));
        assert_eq!(seconds(Some("debug=1")), Ok(30));
        assert_eq!(seconds(Some("seconds=5")), Ok(5));
        assert_eq!(seconds(Some("a=b&seconds=300")), Ok(300));
        for bad in [
            "seconds=0",
            "seconds=301",
            "seconds=-1",
            "seconds=x",
            "seconds=",
        ] {
            assert!(seconds(Some(bad)).is_err(), "{bad}");
        }
    }
}
