//! `commitfs stats DIR [--json]`: live counters of a running mount.
//!
//! The mount daemon serves its counters on a Unix socket whose path is derived
//! from the mount point (`/run/commitfs/<hash>.sock`); `commitfs stats` connects,
//! sends `stats`, reads one JSON document and prints it. The same socket takes
//! `sync` (`commitfs sync DIR`): the kernel never passes sync(1) or syncfs(2)
//! on to a FUSE daemon (it sends FUSE_SYNCFS to virtiofs only), so cached data
//! of a mount would otherwise wait for the next commit. Counters come from the device layer
//! (I/O by category, flushes, FUA writes), the journal (commits, log blocks,
//! checkpoints, revokes) and the fast-commit path (like the kernel's fc_info).

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{anyhow, Context, Result};
use commitfs_device::IoCategory;
use commitfs_fs::Fs;
use serde_json::{json, Value};

/// Socket path for the mount at `dir` (canonicalised, hashed with FNV-1a).
pub fn socket_path(dir: &Path) -> PathBuf {
    let canon = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in canon.as_os_str().as_encoded_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let base = if std::fs::create_dir_all("/run/commitfs").is_ok() {
        PathBuf::from("/run/commitfs")
    } else {
        let p = std::env::temp_dir().join("commitfs-run");
        let _ = std::fs::create_dir_all(&p);
        p
    };
    base.join(format!("{h:016x}.sock"))
}

/// Every counter of a mounted file system as JSON.
pub fn stats_json(fs: &Fs, fuse: Option<&commitfs_fuse::FuseStats>) -> Value {
    let s = fs.stats();
    let fc = fs.fc_stats();
    let ring = fuse.map_or((0, 0), |f| f.ring());
    let poll = fuse.map_or((0, 0, 0), |f| f.poll());
    let reads = fuse.map_or((0, 0), |f| f.reads_deferred());
    let relief = fuse.map_or((0, 0), |f| f.relief());
    let mut dev = serde_json::Map::new();
    for c in IoCategory::ALL {
        let k = s.device.category(c);
        dev.insert(
            c.name().to_string(),
            json!({
                "reads": k.reads, "read_bytes": k.read_bytes,
                "writes": k.writes, "write_bytes": k.write_bytes,
                "fua_writes": k.fua_writes,
            }),
        );
    }
    let j = s.journal;
    let fc_commits = fc.commits.max(1) as f64;
    let per_commit = |ns: u64| {
        if j.commits == 0 {
            0.0
        } else {
            ns as f64 / j.commits as f64 / 1000.0
        }
    };
    let m = fs.meta_cache_stats();
    json!({
        "journal_mode": s.journal_mode,
        "device": dev,
        "flushes": s.device.flushes,
        "fua_writes": IoCategory::ALL.iter().map(|c| s.device.category(*c).fua_writes).sum::<u64>(),
        "data_bytes": s.device.data.write_bytes,
        "metadata_bytes": s.device.metadata.write_bytes,
        "journal_bytes": s.device.journal.write_bytes,
        "fast_commit_bytes": s.device.fast_commit.write_bytes,
        "journal": {
            "commits": j.commits,
            "handles": j.handles,
            "buffers_logged": j.buffers_written,
            "log_blocks": j.log_blocks,
            "checkpoints": j.checkpoints,
            "revokes": j.revokes,
            "flushes": j.flushes,
            "fsyncs": s.fsyncs,
            "fdatasyncs_data_only": s.fdatasyncs_data_only,
            "metadata_reads_unlocked": s.metadata_reads_unlocked,
            "reads_locked": s.reads_locked,
            "flushes_per_fsync": if s.fsyncs == 0 { 0.0 } else { s.device.flushes as f64 / s.fsyncs as f64 },
            "in_flight": j.inflight,
            "max_in_flight": j.max_inflight,
            "commits_per_flush": if j.commit_flushes == 0 { 0.0 } else { j.commits_by_flush as f64 / j.commit_flushes as f64 },
            "max_commits_per_flush": j.max_commits_per_flush,
            "handles_per_commit": if j.commits == 0 { 0.0 } else { j.commit_handles as f64 / j.commits as f64 },
            "coalescing_unlocks": j.lock_unlocks,
            "fast_commits_chained": j.fc_chained,
            "durability_waits": j.durability_waits,
            "avg_durability_wait_us": if j.durability_waits == 0 { 0.0 } else { j.durability_wait_ns as f64 / j.durability_waits as f64 / 1000.0 },
            "commit_phases_us": {
                "batch": per_commit(j.batch_ns),
                "lock": per_commit(j.lock_ns),
                "log_write": per_commit(j.log_write_ns),
                "to_durable": per_commit(j.commit_ns),
            },
            "avg_flush_us": j.flush_avg_ns as f64 / 1000.0,
            // Sums behind the averages and ratios above, so that a reader
            // taking the difference of two snapshots (`commitfs bench`) can
            // derive them for the interval.
            "totals": {
                "durability_wait_us": j.durability_wait_ns / 1000,
                "batch_us": j.batch_ns / 1000,
                "lock_us": j.lock_ns / 1000,
                "log_write_us": j.log_write_ns / 1000,
                "to_durable_us": j.commit_ns / 1000,
                "commit_flushes": j.commit_flushes,
                "commits_by_flush": j.commits_by_flush,
                "commit_handles": j.commit_handles,
            },
        },
        "fast_commit": {
            "commits": fc.commits,
            "blocks": fc.blocks,
            "single_block_fraction": if fc.commits == 0 { 0.0 } else { fc.single_block as f64 / fc_commits },
            "avg_commit_us": if fc.commits == 0 { 0.0 } else { fc.total_ns as f64 / fc_commits / 1000.0 },
            "skipped": fc.skipped,
            "data_csum_confirms": fc.confirms,
            "ineligible": fc.ineligible,
        },
        "fuse_requests": fuse_json(fuse),
        "fuse_ring": {
            "queues": ring.0,
            "requests": ring.1,
        },
        "fuse_poll": {
            "budget_us": poll.0,
            "polled": poll.1,
            "slept": poll.2,
            "reliefs": relief.0,
            "relieved": relief.1,
        },
        "fuse_reads_deferred": {
            "reads": reads.0,
            "max_at_once": reads.1,
        },
        "page_cache": fs.cache_stats().map(|c| json!({
            "cached_bytes": c.cached_bytes,
            "dirty_bytes": c.dirty_bytes,
            "bytes_written": c.bytes_written,
            "read_hits": c.read_hits,
            "read_fills": c.read_fills,
            "writebacks": c.writebacks,
            "cuts": c.cuts,
            "blocks_written": c.blocks_written,
            "device_writes": c.device_writes,
            "dropped_dirty": c.dropped_dirty,
            "evicted": c.evicted,
            "data_order": fs.options().data_order.name(),
        })),
        "metadata_caches": json!({
                "buffers": m.buffers,
                "running_buffers": m.running_buffers,
                "running_cap": m.running_cap,
                "inodes": m.inodes.cached,
                "inode_cap": m.inodes.cap,
                "inodes_evicted": m.inodes.evicted,
                "dirs": m.dirs.cached,
                "dir_bytes": m.dirs.bytes,
                "dir_budget": m.dirs.budget,
                "dir_loads": m.dirs.loads,
                "dirs_evicted": m.dirs.evicted,
                "dir_probes": m.dirs.probes,
                "dir_scans": m.dirs.scans,
            }),
    })
}

/// FUSE requests by kind: count and mean service time in the daemon.
fn fuse_json(fuse: Option<&commitfs_fuse::FuseStats>) -> Value {
    let mut m = serde_json::Map::new();
    for t in fuse.map(|f| f.snapshot()).unwrap_or_default() {
        m.insert(
            t.name.to_string(),
            json!({ "count": t.count, "total_us": t.nanos / 1000, "mean_us": t.nanos as f64 / t.count as f64 / 1000.0 }),
        );
    }
    Value::Object(m)
}

/// Serves `stats_json` on the mount's socket until dropped.
///
/// Bound before the FUSE mount appears, so that whoever sees the mount (in
/// `/proc/mounts`) can already ask for its counters; the FUSE session's own
/// counters are attached once the session exists ([`StatsServer::attach`]).
pub struct StatsServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    fuse: Arc<OnceLock<Arc<commitfs_fuse::FuseStats>>>,
    /// Joined on drop: the thread holds the `Fs`, whose last reference must
    /// be dropped by the caller (a mount that failed writes everything home
    /// in `Fs::drop`, before the process exits).
    thread: Option<std::thread::JoinHandle<()>>,
    /// The listening socket (owned by the thread), shut down to stop it.
    listener_fd: std::os::fd::RawFd,
}

impl StatsServer {
    /// Report the FUSE session's request counters from now on.
    pub fn attach(&self, fuse: Arc<commitfs_fuse::FuseStats>) {
        let _ = self.fuse.set(fuse);
    }
}

impl Drop for StatsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so the thread ends (a shutdown listener's
        // accept fails at once; connecting would need write permission on
        // the socket, which a sandboxed daemon no longer has), then remove
        // the socket (the sandbox's monitor does when this cannot).
        // SAFETY: shutdown of a descriptor the thread owns until joined below.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        let _ = std::fs::remove_file(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn serve(fs: Arc<Fs>, dir: &Path) -> Result<StatsServer> {
    let path = socket_path(dir);
    // A socket someone answers on belongs to a live mount at the same
    // directory (this one would go on top of it, or fail): leave it alone.
    if UnixStream::connect(&path).is_ok() {
        return Err(anyhow!(
            "{} is served by another commitfs mount at {}",
            path.display(),
            dir.display()
        ));
    }
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)
        .with_context(|| format!("binding the stats socket {}", path.display()))?;
    let listener_fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let fuse: Arc<OnceLock<Arc<commitfs_fuse::FuseStats>>> = Arc::default();
    let fuse2 = fuse.clone();
    let thread = std::thread::Builder::new()
        .name("commitfs-stats".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::Acquire) {
                    break;
                }
                if let Ok(mut c) = conn {
                    let body = match read_request(&c).as_deref() {
                        // During the unmount (FUSE's destroy runs before
                        // this server stops) the unmount's own commits are
                        // the only ones: a commit after its last would land
                        // in a closed log.
                        Some("sync") if fs.is_unmounting() => json!({
                            "ok": false,
                            "error": "the file system is being unmounted (`commitfs umount` waits until everything is home)"
                        }),
                        Some("sync") => match fs.sync() {
                            Ok(()) => json!({ "ok": true }),
                            Err(e) => json!({ "ok": false, "error": e.to_string() }),
                        },
                        _ => stats_json(&fs, fuse2.get().map(|f| &**f)),
                    };
                    let _ = c.write_all(body.to_string().as_bytes());
                }
            }
        })
        .context("starting the stats thread")?;
    Ok(StatsServer {
        path,
        stop,
        fuse,
        thread: Some(thread),
        listener_fd,
    })
}

/// The request line a client sent (`None`: nothing within a second, or not
/// UTF-8): read without blocking the server for longer (`ppoll`, allowed by
/// the sandbox, where socket timeouts are not).
fn read_request(c: &UnixStream) -> Option<String> {
    use std::os::fd::AsRawFd;
    let mut buf = Vec::with_capacity(16);
    let mut byte = [0u8; 1];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    while buf.len() < 64 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return None;
        }
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        let mut pfd = libc::pollfd {
            fd: c.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, a valid timespec, no signal mask.
        match unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) } {
            // A signal (glibc's set*id broadcast when the sandbox drops root
            // reaches every thread) is not the client's silence: poll again.
            r if r < 0
                && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted =>
            {
                continue
            }
            r if r <= 0 => return None,
            _ => {}
        }
        match (&*c).read(&mut byte) {
            Ok(1) if byte[0] != b'\n' => buf.push(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            _ => break,
        }
    }
    String::from_utf8(buf).ok()
}

/// Send `request` to the daemon of the mount at `dir`; its JSON reply.
fn ask(dir: &Path, request: &str) -> Result<Value> {
    let path = socket_path(dir);
    let mut c = UnixStream::connect(&path).map_err(|e| {
        anyhow!(
            "no commitfs mount at {} ({}: {e}); is it mounted with `commitfs mount`?",
            dir.display(),
            path.display()
        )
    })?;
    c.write_all(format!("{request}\n").as_bytes())?;
    let mut body = String::new();
    c.read_to_string(&mut body)?;
    serde_json::from_str(&body).context("parsing the daemon's reply")
}

/// `commitfs sync DIR`: everything written through the mount before the
/// call is durable when it returns (data, metadata, a full commit).
pub fn sync(dir: &Path) -> Result<()> {
    let v = ask(dir, "sync")?;
    if v["ok"].as_bool() == Some(true) {
        return Ok(());
    }
    Err(anyhow!(
        "sync of {} failed: {}",
        dir.display(),
        v["error"].as_str().unwrap_or("no answer")
    ))
}

/// `commitfs stats DIR`.
pub fn run(dir: &Path, as_json: bool) -> Result<()> {
    let v = ask(dir, "stats")?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "journal mode: {}",
        v["journal_mode"].as_str().unwrap_or("?")
    );
    println!(
        "device: data {} B, metadata {} B, journal {} B, fast-commit {} B written; {} flushes, {} FUA writes",
        v["data_bytes"], v["metadata_bytes"], v["journal_bytes"], v["fast_commit_bytes"], v["flushes"], v["fua_writes"]
    );
    let j = &v["journal"];
    println!(
        "journal: {} commits, {} log blocks, {} checkpoints, {} revokes",
        j["commits"], j["log_blocks"], j["checkpoints"], j["revokes"]
    );
    println!(
        "pipeline: {} fsyncs ({} fdatasyncs with data only), {:.3} flushes per fsync, {} in flight (max {}), {:.2} commits per flush \
         (max {}), {:.1} handles per commit, {} coalescing unlocks, {} fast commits chained, avg durability wait {:.0} us",
        j["fsyncs"],
        j["fdatasyncs_data_only"],
        j["flushes_per_fsync"].as_f64().unwrap_or(0.0),
        j["in_flight"],
        j["max_in_flight"],
        j["commits_per_flush"].as_f64().unwrap_or(0.0),
        j["max_commits_per_flush"],
        j["handles_per_commit"].as_f64().unwrap_or(0.0),
        j["coalescing_unlocks"],
        j["fast_commits_chained"],
        j["avg_durability_wait_us"].as_f64().unwrap_or(0.0)
    );
    let ph = &j["commit_phases_us"];
    let us = |x: &serde_json::Value| x.as_f64().unwrap_or(0.0);
    println!(
        "commit phases (avg per full commit): batching {:.0} us, locking and cut {:.0} us, log write {:.0} us, to durable {:.0} us; device flush {:.0} us",
        us(&ph["batch"]),
        us(&ph["lock"]),
        us(&ph["log_write"]),
        us(&ph["to_durable"]),
        us(&j["avg_flush_us"])
    );
    let f = &v["fast_commit"];
    println!(
        "fast commit: {} commits, {} blocks, single-block {:.0}%, avg {:.0} us; ineligible {}",
        f["commits"],
        f["blocks"],
        f["single_block_fraction"].as_f64().unwrap_or(0.0) * 100.0,
        f["avg_commit_us"].as_f64().unwrap_or(0.0),
        f["ineligible"]
    );
    let c = &v["page_cache"];
    if c.is_object() {
        println!(
            "page cache (data_order={}): {} B cached ({} B dirty); {} B written into it, {} reads answered from it, {} blocks kept from device reads; \
             {} blocks written back in {} device writes ({} file write-backs, {} commit cuts); \
             {} dirty pages dropped unwritten, {} evicted",
            c["data_order"].as_str().unwrap_or("?"),
            c["cached_bytes"],
            c["dirty_bytes"],
            c["bytes_written"],
            c["read_hits"],
            c["read_fills"],
            c["blocks_written"],
            c["device_writes"],
            c["writebacks"],
            c["cuts"],
            c["dropped_dirty"],
            c["evicted"]
        );
    } else {
        println!("page cache: off (-o nocache)");
    }
    let m = &v["metadata_caches"];
    if m.is_object() {
        println!(
            "metadata caches: {} buffers ({} in the running transaction, committed at {}); \
             {} inodes (cap {}, {} evicted); {} directories, {} B \
             (budget {} B; {} loaded, {} evicted, {} lookups by htree probe, {} by scan)",
            m["buffers"],
            m["running_buffers"],
            m["running_cap"],
            m["inodes"],
            m["inode_cap"],
            m["inodes_evicted"],
            m["dirs"],
            m["dir_bytes"],
            m["dir_budget"],
            m["dir_loads"],
            m["dirs_evicted"],
            m["dir_probes"],
            m["dir_scans"]
        );
    }
    if let Some(m) = v["fuse_requests"].as_object().filter(|m| !m.is_empty()) {
        let mut rows: Vec<_> = m.iter().collect();
        rows.sort_by_key(|(_, r)| std::cmp::Reverse(r["total_us"].as_u64().unwrap_or(0)));
        let row = |(k, r): &(&String, &Value)| {
            format!(
                "{k} {} x {:.0} us",
                r["count"],
                r["mean_us"].as_f64().unwrap_or(0.0)
            )
        };
        println!(
            "FUSE requests (count x mean time in the daemon, most time first): {}",
            rows.iter().map(row).collect::<Vec<_>>().join(", ")
        );
        let ring = &v["fuse_ring"];
        match ring["queues"].as_u64().unwrap_or(0) {
            0 => {
                let p = &v["fuse_poll"];
                match p["budget_us"].as_u64().unwrap_or(0) {
                    0 => println!("FUSE transport: /dev/fuse"),
                    us => println!(
                        "FUSE transport: /dev/fuse, one loop polling {us} us after each request: \
                         {} requests found while polling, {} sleeps; relief loop took over {} \
                         times from a request held over 2 ms and served {} requests",
                        p["polled"], p["slept"], p["reliefs"], p["relieved"]
                    ),
                }
            }
            q => println!(
                "FUSE transport: io_uring, {q} queues (one per CPU), {} requests through the rings",
                ring["requests"]
            ),
        }
    }
    Ok(())
}
