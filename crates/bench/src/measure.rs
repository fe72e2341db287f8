//! Measurement helpers: latency percentiles, a device-counter sampler (for p95
//! IOPS and bandwidth), and CPU time of processes and threads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::device::{BenchDevice, DevCounters};

/// Latency summary in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatSummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// (latency µs, cumulative fraction), ≤ 200 points, for the CDF plot.
    #[serde(default)]
    pub cdf: Vec<(f64, f64)>,
}

/// Percentile of sorted values (nearest rank).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn summarize(mut v: Vec<f64>) -> Option<LatSummary> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let n = v.len();
    let mut cdf = Vec::new();
    let step = (n / 200).max(1);
    for i in (0..n).step_by(step) {
        cdf.push((v[i], (i + 1) as f64 / n as f64));
    }
    if cdf.last().map(|c| c.1) != Some(1.0) {
        cdf.push((v[n - 1], 1.0));
    }
    Some(LatSummary {
        count: n as u64,
        mean_us: v.iter().sum::<f64>() / n as f64,
        p50_us: percentile(&v, 50.0),
        p95_us: percentile(&v, 95.0),
        p99_us: percentile(&v, 99.0),
        max_us: v[n - 1],
        cdf,
    })
}

/// Samples the device counters every 100 ms while a workload runs.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<(f64, DevCounters)>>>,
    thread: Option<JoinHandle<()>>,
}

/// p95 of the device's IOPS (reads + writes; flushes are not billed as I/Os) and
/// bandwidth (read + write bytes) over 1-second windows sliding by 100 ms; a run
/// shorter than 2 s gives its average instead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Peak {
    pub p95_iops: f64,
    pub p95_mbps: f64,
    pub avg_iops: f64,
    pub avg_mbps: f64,
}

impl Sampler {
    pub fn start(dev: &BenchDevice) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        // Read counters through a closure-free path: the device is not Sync-shared
        // here, so sample the sysfs/shared file by reopening it cheaply.
        let reader = dev.counter_reader();
        let (s2, st2) = (samples.clone(), stop.clone());
        let t0 = Instant::now();
        let thread = std::thread::Builder::new()
            .name("bench-sampler".into())
            .spawn(move || loop {
                if let Ok(c) = reader() {
                    s2.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((t0.elapsed().as_secs_f64(), c));
                }
                if st2.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            })
            .ok();
        Sampler {
            stop,
            samples,
            thread,
        }
    }

    pub fn finish(mut self) -> Peak {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let s = std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()));
        peak(&s)
    }
}

fn ios(c: &DevCounters) -> f64 {
    (c.reads + c.writes) as f64
}
fn bytes(c: &DevCounters) -> f64 {
    (c.read_bytes + c.write_bytes) as f64
}

pub fn peak(s: &[(f64, DevCounters)]) -> Peak {
    if s.len() < 2 {
        return Peak::default();
    }
    let (t0, c0) = &s[0];
    let (t1, c1) = &s[s.len() - 1];
    let dt = (t1 - t0).max(1e-6);
    let avg_iops = (ios(c1) - ios(c0)) / dt;
    let avg_mbps = (bytes(c1) - bytes(c0)) / dt / 1e6;
    if dt < 2.0 {
        return Peak {
            p95_iops: avg_iops,
            p95_mbps: avg_mbps,
            avg_iops,
            avg_mbps,
        };
    }
    let mut iops = Vec::new();
    let mut mbps = Vec::new();
    let mut j = 0;
    for i in 0..s.len() {
        while j < s.len() && s[j].0 - s[i].0 < 1.0 {
            j += 1;
        }
        if j >= s.len() {
            break;
        }
        let w = s[j].0 - s[i].0;
        iops.push((ios(&s[j].1) - ios(&s[i].1)) / w);
        mbps.push((bytes(&s[j].1) - bytes(&s[i].1)) / w / 1e6);
    }
    let sort =
        |v: &mut Vec<f64>| v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    sort(&mut iops);
    sort(&mut mbps);
    Peak {
        p95_iops: percentile(&iops, 95.0),
        p95_mbps: percentile(&mbps, 95.0),
        avg_iops,
        avg_mbps,
    }
}

/// Least µs per call of five batches of `getxattr(dir, "user.…", 0)` for a
/// name nobody sets, after a 100 ms pause: through FUSE a request the daemon
/// answers from memory, i.e. the transport's own cost per request on this
/// machine (the kernel's file systems answer it in-kernel). The least batch,
/// since a floor must not include what a commit or write-back still running
/// from the point took from it. None when the call fails otherwise than
/// with ENODATA (or ENOTSUP: no user xattrs, still a full round trip).
pub fn null_round_trip_us(dir: &std::path::Path) -> Option<f64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let name = c"user.commitfs-bench-null";
    let call = || {
        // SAFETY: NUL-terminated path and name; a null buffer of size 0 only
        // asks for the value's size.
        let r = unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
        let e = std::io::Error::last_os_error().raw_os_error();
        r < 0 && matches!(e, Some(libc::ENODATA) | Some(libc::ENOTSUP))
    };
    std::thread::sleep(Duration::from_millis(100));
    if !call() {
        return None;
    }
    const CALLS: u32 = 1000;
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..CALLS {
                call();
            }
            t.elapsed().as_secs_f64() * 1e6 / CALLS as f64
        })
        .min_by(f64::total_cmp)
}

/// CPU seconds (user + system) of a process or thread from /proc/PID/stat.
pub fn proc_cpu_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state(0) ... utime is field 14 overall = index 11 here.
    let ut: f64 = f.get(11)?.parse().ok()?;
    let st: f64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((ut + st) / hz.max(1.0))
}

/// CPU seconds used by this process (`RUSAGE_SELF`) or its reaped children.
pub fn rusage_secs(children: bool) -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    unsafe {
        let mut r: libc::rusage = std::mem::zeroed();
        libc::getrusage(
            if children {
                libc::RUSAGE_CHILDREN
            } else {
                libc::RUSAGE_SELF
            },
            &mut r,
        );
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        tv(r.ru_utime) + tv(r.ru_stime)
    }
}

/// The pid of a kernel thread by its exact name (e.g. `jbd2/loop3-8`).
pub fn find_kthread(name: &str) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(c) = std::fs::read_to_string(format!("/proc/{pid}/comm")) {
            if c.trim_end() == name {
                return Some(pid);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 95.0), 95.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        let s = summarize(v).unwrap();
        assert_eq!(s.count, 100);
        assert_eq!(s.max_us, 100.0);
        assert!((s.mean_us - 50.5).abs() < 1e-9);
        assert_eq!(s.cdf.last().unwrap().1, 1.0);
    }

    #[test]
    fn peak_uses_sliding_windows() {
        // 3 s at 100 IOPS, then 1 s at 1000 IOPS: p95 sees the burst.
        let mut s = Vec::new();
        let mut w = 0u64;
        for i in 0..=40 {
            let t = i as f64 * 0.1;
            s.push((
                t,
                DevCounters {
                    writes: w,
                    write_bytes: w * 4096,
                    ..Default::default()
                },
            ));
            w += if t < 3.0 { 10 } else { 100 };
        }
        let p = peak(&s);
        assert!(p.p95_iops > 800.0, "{p:?}");
        assert!(p.avg_iops < 400.0, "{p:?}");
    }
}
