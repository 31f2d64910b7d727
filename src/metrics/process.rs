//! The process's and the async runtime's figures, read when scraped: Prometheus' standard
//! `process_*` series (what every dashboard and alert for a process expects, and what
//! controller-runtime exports by default), and the tokio runtime's under the crate's prefix.
//!
//! The process figures come from `/proc/self` (Linux; elsewhere they are left out). A scrape
//! reads four small files and counts the open descriptors: no state is kept between scrapes.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The collector of both; the runtime is the one current when the metrics were made, else
/// the one current at the scrape.
#[derive(Debug)]
pub(crate) struct Process {
    pub(crate) runtime: Option<tokio::runtime::Handle>,
}

/// USER_HZ: the unit of the times in `/proc/<pid>/stat`, 100 on every Linux architecture
/// (the kernel's ABI, whatever its internal tick rate).
const TICKS_PER_SECOND: f64 = 100.0;

/// What `/proc/self` says.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Figures {
    pub(crate) cpu_seconds: f64,
    pub(crate) start_time_seconds: f64,
    pub(crate) resident_bytes: f64,
    pub(crate) virtual_bytes: f64,
    pub(crate) threads: f64,
    pub(crate) open_fds: f64,
    pub(crate) max_fds: Option<f64>,
}

impl Figures {
    /// Reads them; `None` where `/proc/self` is not (not Linux) or not as expected.
    pub(crate) fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
        let mut figures = Self::parse(&stat, &status, &boot, &limits)?;
        // Less the descriptor of the directory being read.
        figures.open_fds = open_fds.saturating_sub(1) as f64;
        Some(figures)
    }

    /// The figures in the texts of `/proc/self/stat`, `/proc/self/status`, `/proc/stat` and
    /// `/proc/self/limits` (open descriptors aside).
    pub(crate) fn parse(stat: &str, status: &str, boot: &str, limits: &str) -> Option<Self> {
        // After the command's parenthesised name (which may hold spaces and parentheses),
        // fields from the third on: state, ppid, ... (proc(5)).
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        // proc(5) numbers fields from 1; `fields[0]` is field 3.
        let field = |n: usize| -> Option<f64> { fields.get(n - 3)?.parse::<f64>().ok() };
        let (utime, stime, start_ticks) = (field(14)?, field(15)?, field(22)?);
        let kib = |key: &str| -> Option<f64> {
            let line = status.lines().find(|l| l.starts_with(key))?;
            line[key.len()..]
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        };
        let boot_time = boot
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse::<f64>()
            .ok()?;
        let max_fds = limits
            .lines()
            .find_map(|l| l.strip_prefix("Max open files"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|soft| soft.parse::<f64>().ok());
        Some(Self {
            cpu_seconds: (utime + stime) / TICKS_PER_SECOND,
            start_time_seconds: boot_time + start_ticks / TICKS_PER_SECOND,
            resident_bytes: kib("VmRSS:").unwrap_or(0.0) * 1024.0,
            virtual_bytes: kib("VmSize:").unwrap_or(0.0) * 1024.0,
            threads: kib("Threads:").unwrap_or(0.0),
            open_fds: 0.0,
            max_fds,
        })
    }
}

/// Encodes one value computed at scrape time under `name` (a counter's gets `_total`).
fn emit(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

fn gauge(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    emit(e, name, help, ConstGauge::new(value))
}

fn counter(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    emit(e, name, help, ConstCounter::new(value))
}

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(f) = Figures::read() {
            let e = &mut encoder;
            counter(
                e,
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                f.cpu_seconds,
            )?;
            gauge(
                e,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                f.start_time_seconds,
            )?;
            gauge(
                e,
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                f.resident_bytes,
            )?;
            gauge(
                e,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                f.virtual_bytes,
            )?;
            gauge(
                e,
                "process_threads",
                "Number of OS threads in the process",
                f.threads,
            )?;
            gauge(
                e,
                "process_open_fds",
                "Number of open file descriptors",
                f.open_fds,
            )?;
            if let Some(max) = f.max_fds {
                gauge(
                    e,
                    "process_max_fds",
                    "Maximum number of open file descriptors (the soft limit)",
                    max,
                )?;
            }
        }
        let runtime = self
            .runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        if let Some(runtime) = runtime {
            let m = runtime.metrics();
            let workers = m.num_workers();
            let busy: f64 = (0..workers)
                .map(|w| m.worker_total_busy_duration(w).as_secs_f64())
                .sum();
            let parks: u64 = (0..workers).map(|w| m.worker_park_count(w)).sum();
            let e = &mut encoder;
            gauge(
                e,
                "multicluster_runtime_tokio_workers",
                "Worker threads of the async runtime",
                workers as f64,
            )?;
            gauge(
                e,
                "multicluster_runtime_tokio_alive_tasks",
                "Tasks of the async runtime that have not ended",
                m.num_alive_tasks() as f64,
            )?;
            gauge(
                e,
                "multicluster_runtime_tokio_global_queue_depth",
                "Tasks waiting in the async runtime's global queue (a steady rise: the workers cannot keep up)",
                m.global_queue_depth() as f64,
            )?;
            counter(
                e,
                "multicluster_runtime_tokio_busy_seconds",
                "Seconds the async runtime's workers were busy, summed over workers (its rate over the worker count: how busy they are)",
                busy,
            )?;
            counter(
                e,
                "multicluster_runtime_tokio_worker_parks",
                "Times the async runtime's workers parked (went idle), summed over workers",
                parks as f64,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_texts_are_read_whatever_the_commands_name() {
        // A name with a space and a parenthesis; utime 250, stime 50, starttime 1000 ticks.
        let stat = "4242 (my (op) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 123456 789 18446744073709551615";
        let status = "Name:\tx\nVmSize:\t  123456 kB\nVmRSS:\t    2048 kB\nThreads:\t7\n";
        let boot = "cpu  1 2 3\nbtime 1700000000\nprocesses 5\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        let f = Figures::parse(stat, status, boot, limits).unwrap();
        assert_eq!(f.cpu_seconds, 3.0);
        assert_eq!(f.start_time_seconds, 1_700_000_010.0);
        assert_eq!(f.resident_bytes, 2048.0 * 1024.0);
        assert_eq!(f.virtual_bytes, 123_456.0 * 1024.0);
        assert_eq!(f.threads, 7.0);
        assert_eq!(f.max_fds, Some(1024.0));
        assert_eq!(Figures::parse("garbage", status, boot, limits), None);
        assert_eq!(Figures::parse(stat, status, "no btime", limits), None);
    }

    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_scrape_shows_this_process_and_its_runtime() {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Process {
            runtime: Some(tokio::runtime::Handle::current()),
        }));
        let _held = std::fs::File::open("/proc/self/stat").unwrap();
        // Three tasks that stay until released; a task that keeps a worker busy for 50 ms.
        let (release, released) = tokio::sync::watch::channel(());
        for _ in 0..3 {
            let mut released = released.clone();
            tokio::spawn(async move { released.changed().await });
        }
        tokio::spawn(async {
            let until = std::time::Instant::now() + std::time::Duration::from_millis(50);
            while std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
        })
        .await
        .unwrap();
        let scrape = || {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            text
        };
        let read = |text: &str, name: &str| -> Option<f64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))?
                .parse()
                .ok()
        };
        // A worker adds its busy time to the runtime's figures when it parks or after a
        // batch of tasks: until then the spin is not counted.
        let mut text = scrape();
        for _ in 0..200 {
            if read(&text, "multicluster_runtime_tokio_busy_seconds_total")
                .is_some_and(|b| b >= 0.05)
            {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            text = scrape();
        }
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .unwrap_or_else(|| panic!("{name} not in\n{text}"))
                .parse()
                .unwrap()
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(
            started <= now + 1.0 && started > now - 24.0 * 3600.0,
            "{started}"
        );
        assert!(value("process_cpu_seconds_total") > 0.0);
        assert!(value("process_resident_memory_bytes") > 1024.0 * 1024.0);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(
            value("process_threads") >= 3.0,
            "two workers and the test's thread"
        );
        let (open, max) = (value("process_open_fds"), value("process_max_fds"));
        assert!(open >= 4.0 && open <= max, "{open} of {max}");
        assert_eq!(value("multicluster_runtime_tokio_workers"), 2.0);
        assert!(value("multicluster_runtime_tokio_alive_tasks") >= 3.0);
        assert!(value("multicluster_runtime_tokio_busy_seconds_total") >= 0.05);
        release.send(()).unwrap();
    }

    /// The figure in BENCHMARKS.md: what the process and runtime series add to a scrape.
    /// `cargo test --release --lib --all-features process_series_scrape_cost -- --ignored --nocapture`
    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement: run by hand, figures in BENCHMARKS.md"]
    async fn process_series_scrape_cost() {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Process {
            runtime: Some(tokio::runtime::Handle::current()),
        }));
        let mut text = String::new();
        let runs = 2000u32;
        let started = std::time::Instant::now();
        for _ in 0..runs {
            text.clear();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        }
        let each = started.elapsed() / runs;
        println!(
            "process and runtime series: {each:?} per scrape, {} bytes",
            text.len()
        );
        assert!(text.contains("process_open_fds"));
    }
}
