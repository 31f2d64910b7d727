//! Child processes of the test control plane: spawning with a log file, graceful stop, and a
//! guardian that cleans up after a test binary that dies without unwinding.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How long a process gets to exit after SIGTERM before it is killed.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(20);

/// A running etcd or kube-apiserver, stopped when dropped.
pub(crate) struct ManagedProcess {
    /// What it is, for messages: `kube-apiserver` or `etcd`.
    pub(crate) kind: &'static str,
    child: Child,
    /// Where its stdout and stderr go.
    pub(crate) log: PathBuf,
    /// Kept to tell the guardian when this process is gone.
    guardian: std::sync::Arc<Guardian>,
    exited: Option<ExitStatus>,
}

impl ManagedProcess {
    /// Starts `binary` with `args`, its output appended to `log`, watched by `guardian`.
    pub(crate) fn spawn(
        kind: &'static str,
        binary: &Path,
        args: &[String],
        log: PathBuf,
        guardian: std::sync::Arc<Guardian>,
    ) -> io::Result<Self> {
        let out = File::options().create(true).append(true).open(&log)?;
        let err = out.try_clone()?;
        let child = Command::new(binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()?;
        guardian.watch(child.id());
        Ok(Self {
            kind,
            child,
            log,
            guardian,
            exited: None,
        })
    }

    /// The operating system's id of the process.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has exited (without blocking).
    pub(crate) fn try_exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            self.exited = Some(status);
            self.guardian.unwatch(self.child.id());
        }
        self.exited
    }

    fn terminate(&mut self) {
        if self.try_exited().is_none() {
            // The pid is our own un-reaped child, so it cannot have been reused. A paused
            // (SIGSTOP) process handles SIGTERM only once continued.
            let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
            let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGCONT);
        }
    }

    /// Sends `signal` if the process is still running; whether it was.
    pub(crate) fn signal(&mut self, signal: Signal) -> bool {
        self.try_exited().is_none() && kill(Pid::from_raw(self.child.id() as i32), signal).is_ok()
    }

    /// SIGKILL now, and reap.
    pub(crate) fn kill_now(&mut self) {
        self.force();
    }

    fn force(&mut self) {
        let _ = self.child.kill();
        if let Ok(status) = self.child.wait() {
            self.exited = Some(status);
        }
        self.guardian.unwatch(self.child.id());
    }

    /// SIGTERM, then SIGKILL after [`STOP_GRACE`]; blocks the thread (used from `Drop`).
    pub(crate) fn stop_blocking(&mut self) {
        self.terminate();
        let deadline = Instant::now() + STOP_GRACE;
        while self.try_exited().is_none() {
            if Instant::now() >= deadline {
                self.force();
                return;
            }
            std::thread::sleep(POLL);
        }
    }

    /// SIGTERM, then SIGKILL after [`STOP_GRACE`], without blocking the runtime.
    pub(crate) async fn stop(&mut self) {
        self.terminate();
        let deadline = Instant::now() + STOP_GRACE;
        while self.try_exited().is_none() {
            if Instant::now() >= deadline {
                self.force();
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The last `lines` lines of its log.
    pub(crate) fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.stop_blocking();
    }
}

/// The last `lines` lines of the file at `path` (at most the last 64 KiB are read).
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    const MAX: u64 = 64 * 1024;
    let mut buf = Vec::new();
    if let Ok(mut f) = File::open(path) {
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(MAX)));
        let _ = f.read_to_end(&mut buf);
    }
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A small `sh` process that outlives an abnormal exit of the test binary and then stops the
/// control plane processes it was told about.
///
/// `Drop` stops every process when a test returns or panics, but not when the test binary is
/// killed, aborts or calls `exit`. The guardian reads process ids from a pipe (`+pid` to watch,
/// `-pid` to forget); when the pipe closes, because the environment was dropped or because our
/// process died, it sends SIGTERM and, after a grace period, SIGKILL to whatever is still
/// watched. This needs no `unsafe` `pre_exec` hook and, unlike `PR_SET_PDEATHSIG`, does not
/// depend on which thread spawned the process.
pub(crate) struct Guardian {
    stdin: Mutex<Option<ChildStdin>>,
    child: Mutex<Option<Child>>,
}

/// `$1` is the environment's directory: removed once its processes are gone (a test binary
/// that aborts never runs the directory's own cleanup).
const GUARDIAN_SCRIPT: &str = r#"
trap '' INT TERM HUP
dir=$1
pids=" "
while IFS= read -r line; do
  case "$line" in
    +*) pids="$pids${line#+} " ;;
    -*) pids=$(printf '%s' "$pids" | sed "s/ ${line#-} / /") ;;
  esac
done
set -- $pids
if [ $# -gt 0 ]; then
  kill -TERM "$@" 2>/dev/null
  i=0
  while [ $i -lt 50 ]; do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && break
    sleep 0.1
    i=$((i+1))
  done
  [ $alive -eq 0 ] || { kill -KILL "$@" 2>/dev/null; sleep 0.2; }
fi
[ -n "$dir" ] && rm -rf -- "$dir"
exit 0
"#;

impl Guardian {
    /// Starts the guardian process for the environment in `dir`.
    pub(crate) fn spawn(dir: &std::path::Path) -> io::Result<Self> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(GUARDIAN_SCRIPT)
            .arg("mcr-testenv-guardian")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = child.stdin.take();
        Ok(Self {
            stdin: Mutex::new(stdin),
            child: Mutex::new(Some(child)),
        })
    }

    fn send(&self, line: &str) {
        let mut stdin = crate::lock(&self.stdin);
        if let Some(pipe) = stdin.as_mut() {
            // A failed write means the guardian is gone; Drop still cleans up normally.
            let _ = pipe.write_all(line.as_bytes()).and_then(|()| pipe.flush());
        }
    }

    fn watch(&self, pid: u32) {
        self.send(&format!("+{pid}\n"));
    }

    fn unwatch(&self, pid: u32) {
        self.send(&format!("-{pid}\n"));
    }
}

impl Drop for Guardian {
    fn drop(&mut self) {
        // Closing the pipe lets the guardian exit; every process was already stopped and
        // forgotten, so it has nothing left to kill. Reap it so it leaves no zombie.
        drop(crate::lock(&self.stdin).take());
        if let Some(mut child) = crate::lock(&self.child).take() {
            let _ = child.wait();
        }
    }
}
