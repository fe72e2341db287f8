//! Concurrent crash workloads (issue #10, acceptance 1; design B and migration
//! step 1): 8 and 16 threads on one [`Fs`] with no workload lock, shaped like
//! varmail (one shared directory, or one per thread) and fs_mark -S 1, and a
//! checker that is right without knowing how the threads interleaved.
//!
//! Every thread touches only its own names (`t<thread>f<n>`), so each thread has
//! its own model: `states[i]`, its files after its first `i` operations. Because
//! the operations of one thread join non-decreasing transactions and recovery
//! replays a tid prefix (design B, I2/I5), after a crash:
//!
//! * (a) for every thread the recovered files equal `states[p]` for some `p`
//!   between `lo` and `hi`: `hi` counts the thread's operations that had started
//!   before the crash point, `lo` is
//! * (b) the prefix every fsync/fsyncdir acknowledged before the crash demands: an
//!   fsync of a file covers the thread's last operation on that file, an fsyncdir
//!   its last create/unlink (and, by the prefix property, everything before);
//! * (c) every file's content equals its model content exactly (append-only
//!   files: no stale or foreign block, no zeros where data was acknowledged);
//! * (f) across threads, tids grow with time: an operation that returned before
//!   another began has a tid no greater, so if the later one survived so did the
//!   earlier (a global logical clock orders operation starts and ends);
//! * (d) `e2fsck -fn` is clean after recovery (its output judged);
//! * (e) the JBD2 transactions recovery replays form a contiguous tid run, each
//!   with a commit block that the recording wrote and the image holds; states
//!   where a later transaction's commit block survived but recovery stopped
//!   before it (T+1 durable without T) are counted.
//!
//! Each state's committing transactions in flight come from the device log alone
//! ([`crate::inflight`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use commitfs_device::{CrashLog, CrashSpec, LogOp, RecordingDevice};
use commitfs_format::jbd2;
use commitfs_fs::{Fs, Ino, MountOptions, ROOT_INO};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::check::{fsck_image, mount_opts, ScratchFile};
use crate::inflight::{self, Inflight, MIN_INFLIGHT};
use crate::model::{gen_data, Kind};
use crate::observe::{self, Observed};

/// The shape of a concurrent workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Every thread in one directory: unlink, create + append + fsync, append +
    /// fsync, read (filebench varmail's flow).
    VarmailShared,
    /// The same, one directory per thread.
    VarmailSplit,
    /// fs_mark -S 1: create, write, fsync; one directory per thread.
    FsMark,
}

/// A named concurrent workload.
#[derive(Debug, Clone)]
pub struct ConcSpec {
    pub name: &'static str,
    pub shape: Shape,
    pub threads: usize,
    /// Loop iterations per thread (each is several operations).
    pub iters: usize,
    /// Files a varmail thread keeps before it deletes one.
    pub max_files: usize,
    /// Largest file, in blocks.
    pub max_file_blocks: u64,
}

pub const CONC_WORKLOADS: &[ConcSpec] = &[
    ConcSpec {
        name: "varmail-shared-8",
        shape: Shape::VarmailShared,
        threads: 8,
        iters: 24,
        max_files: 5,
        max_file_blocks: 8,
    },
    ConcSpec {
        name: "varmail-shared-16",
        shape: Shape::VarmailShared,
        threads: 16,
        iters: 14,
        max_files: 4,
        max_file_blocks: 8,
    },
    ConcSpec {
        name: "varmail-split-8",
        shape: Shape::VarmailSplit,
        threads: 8,
        iters: 24,
        max_files: 5,
        max_file_blocks: 8,
    },
    ConcSpec {
        name: "varmail-split-16",
        shape: Shape::VarmailSplit,
        threads: 16,
        iters: 14,
        max_files: 4,
        max_file_blocks: 8,
    },
    ConcSpec {
        name: "fsmark-8",
        shape: Shape::FsMark,
        threads: 8,
        iters: 30,
        max_files: usize::MAX,
        max_file_blocks: 4,
    },
    ConcSpec {
        name: "fsmark-16",
        shape: Shape::FsMark,
        threads: 16,
        iters: 18,
        max_files: usize::MAX,
        max_file_blocks: 4,
    },
];

pub fn find_conc(name: &str) -> Option<&'static ConcSpec> {
    CONC_WORKLOADS.iter().find(|w| w.name == name)
}

/// One file of a thread's model: permissions and the whole content (files are
/// append-only, so the size is the content's length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileState {
    pub perm: u16,
    pub data: Arc<[u8]>,
}

/// A thread's files by name.
pub type ThreadState = Arc<BTreeMap<String, FileState>>;

/// One state-changing operation of a thread.
#[derive(Debug, Clone)]
pub struct OpRec {
    pub desc: String,
    /// Device-log length when it started: crash points `k <= start_idx` cannot
    /// hold any of its effects.
    pub start_idx: usize,
    /// Logical clock when it started and when it returned ([`Shared`]'s order).
    pub start_seq: u64,
    pub end_seq: u64,
}

/// An acknowledged fsync or fsyncdir.
#[derive(Debug, Clone)]
pub struct Ack {
    pub what: String,
    pub start_idx: usize,
    /// Device-log length when it returned.
    pub ret_idx: usize,
    /// Operations of the thread that must survive a crash at `k >= ret_idx`.
    pub covers: usize,
}

/// What one thread did.
#[derive(Debug, Clone)]
pub struct ThreadRec {
    pub dir: String,
    /// `states[i]`: the thread's files after its first `i` operations.
    pub states: Vec<ThreadState>,
    pub ops: Vec<OpRec>,
    pub acks: Vec<Ack>,
    /// fsyncs and fsyncdirs issued (acknowledged or not needed).
    pub fsyncs: usize,
}

impl ThreadRec {
    /// `(lo, hi)` for crash point `k`: the recovered prefix `p` must satisfy
    /// `lo <= p <= hi`.
    pub fn window(&self, k: usize) -> (usize, usize) {
        let lo = self
            .acks
            .iter()
            .filter(|a| a.ret_idx <= k)
            .map(|a| a.covers)
            .max()
            .unwrap_or(0);
        let hi = self.ops.partition_point(|o| o.start_idx < k);
        (lo, hi.max(lo))
    }
}

/// Everything one recorded concurrent run produced.
pub struct ConcRecording {
    pub spec: &'static ConcSpec,
    pub seed: u64,
    pub bs: usize,
    /// Directories the workload made (all children of the root).
    pub dirs: Vec<String>,
    pub log: CrashLog,
    pub threads: Vec<ThreadRec>,
    /// Where the threads started and where the final unmount started in the log.
    pub workload_start: usize,
    pub unmount_start: usize,
    pub fast_commits: u64,
    pub full_commits: u64,
    /// Device flushes while the threads ran.
    pub flushes: u64,
    pub inflight: Inflight,
    /// Commit blocks written: (log index, device offset, tid).
    pub commit_blocks: Vec<(usize, u64, u32)>,
    /// Recorded under `data_order=file`: a thread's append is durable through
    /// that file's fsync only, not through other threads' commits (check (f)).
    pub per_file: bool,
}

impl ConcRecording {
    pub fn ops(&self) -> usize {
        self.threads.iter().map(|t| t.ops.len()).sum()
    }
    pub fn fsyncs(&self) -> usize {
        self.threads.iter().map(|t| t.fsyncs).sum()
    }
}

/// Per-thread bookkeeping while the workload runs.
struct Builder {
    t: usize,
    dir: String,
    dir_ino: Ino,
    rec: ThreadRec,
    inos: HashMap<String, Ino>,
    /// Index (1-based count) of the last operation on each file / on the directory.
    last_on: HashMap<String, usize>,
    last_dir: usize,
    files: u32,
    version: u32,
}

struct Ctx<'a> {
    fs: &'a Fs,
    dev: &'a RecordingDevice,
    clock: &'a AtomicU64,
    spec: &'static ConcSpec,
    bs: usize,
}

const PERMS: &[u16] = &[0o644, 0o600, 0o640];

impl Builder {
    fn cur(&self) -> &BTreeMap<String, FileState> {
        self.rec.states.last().expect("initial state")
    }

    /// Run one state-changing operation and record it; `apply` updates the model.
    fn op<R>(
        &mut self,
        ctx: &Ctx<'_>,
        desc: String,
        file: &str,
        dir_change: bool,
        call: impl FnOnce() -> commitfs_fs::Result<R>,
        apply: impl FnOnce(&mut BTreeMap<String, FileState>),
    ) -> Result<R, String> {
        let start_idx = ctx.dev.op_count();
        let start_seq = ctx.clock.fetch_add(1, Ordering::SeqCst);
        let r = call().map_err(|e| format!("{desc}: {e}"))?;
        let end_seq = ctx.clock.fetch_add(1, Ordering::SeqCst);
        let mut next = self.cur().clone();
        apply(&mut next);
        self.rec.states.push(Arc::new(next));
        self.rec.ops.push(OpRec {
            desc,
            start_idx,
            start_seq,
            end_seq,
        });
        let n = self.rec.ops.len();
        self.last_on.insert(file.to_string(), n);
        if dir_change {
            self.last_dir = n;
        }
        Ok(r)
    }

    fn create(&mut self, ctx: &Ctx<'_>, rng: &mut StdRng) -> Result<String, String> {
        self.files += 1;
        let name = format!("t{}f{}", self.t, self.files);
        let perm = PERMS[rng.gen_range(0..PERMS.len())];
        let (fs, dir_ino) = (ctx.fs, self.dir_ino);
        let desc = format!("create {}/{name}", self.dir);
        let a = self.op(
            ctx,
            desc,
            &name.clone(),
            true,
            || fs.create(dir_ino, name.as_bytes(), perm, 0, 0),
            |m| {
                m.insert(
                    name.clone(),
                    FileState {
                        perm,
                        data: Arc::from(Vec::new()),
                    },
                );
            },
        )?;
        self.inos.insert(name.clone(), a.ino);
        Ok(name)
    }

    /// Append up to two blocks (never past `max_file_blocks`).
    fn append(&mut self, ctx: &Ctx<'_>, rng: &mut StdRng, name: &str) -> Result<(), String> {
        let old = self.cur()[name].data.clone();
        let max = ctx.spec.max_file_blocks as usize * ctx.bs;
        let room = max.saturating_sub(old.len());
        if room == 0 {
            return Ok(());
        }
        let len = if rng.gen_bool(0.3) {
            ctx.bs.min(room)
        } else {
            rng.gen_range(1..=(2 * ctx.bs).min(room))
        };
        self.version += 1;
        let id = 0x4000_0000 | (self.t as u32) << 16 | self.files;
        let bytes = gen_data(id, self.version, old.len() as u64, len);
        let ino = self.inos[name];
        let fs = ctx.fs;
        let off = old.len() as u64;
        let desc = format!("append {}/{name} @{off}+{len}", self.dir);
        let n = self.op(
            ctx,
            desc.clone(),
            name,
            false,
            || fs.write(ino, off, &bytes),
            |m| {
                let f = m.get_mut(name).expect("appended file in the model");
                let mut d = f.data.to_vec();
                d.extend_from_slice(&bytes);
                f.data = Arc::from(d);
            },
        )?;
        if n != len {
            return Err(format!("{desc}: short write {n}"));
        }
        Ok(())
    }

    fn unlink(&mut self, ctx: &Ctx<'_>, name: &str) -> Result<(), String> {
        let (fs, dir_ino) = (ctx.fs, self.dir_ino);
        let desc = format!("unlink {}/{name}", self.dir);
        self.op(
            ctx,
            desc,
            name,
            true,
            || fs.unlink(dir_ino, name.as_bytes()),
            |m| {
                m.remove(name);
            },
        )?;
        self.inos.remove(name);
        Ok(())
    }

    /// fsync of a file (`Some`) or of the thread's directory.
    fn fsync(&mut self, ctx: &Ctx<'_>, rng: &mut StdRng, name: Option<&str>) -> Result<(), String> {
        let covers = match name {
            Some(n) => self.last_on.get(n).copied().unwrap_or(0),
            None => self.last_dir,
        };
        let start_idx = ctx.dev.op_count();
        let what = match name {
            Some(n) => {
                let datasync = rng.gen_bool(0.3);
                ctx.fs
                    .fsync(self.inos[n], datasync)
                    .map_err(|e| format!("fsync {n}: {e}"))?;
                format!(
                    "fsync{} {}/{n}",
                    if datasync { " (data)" } else { "" },
                    self.dir
                )
            }
            None => {
                ctx.fs
                    .fsyncdir(self.dir_ino)
                    .map_err(|e| format!("fsyncdir {}: {e}", self.dir))?;
                format!("fsyncdir {}", self.dir)
            }
        };
        self.rec.fsyncs += 1;
        self.rec.acks.push(Ack {
            what,
            start_idx,
            ret_idx: ctx.dev.op_count(),
            covers,
        });
        Ok(())
    }

    /// Read a file back and compare with the model (the live file system must be
    /// right before crashes are considered).
    fn read(&mut self, ctx: &Ctx<'_>, name: &str) -> Result<(), String> {
        let want = self.cur()[name].data.clone();
        let mut buf = vec![0u8; want.len() + 1];
        let n = ctx
            .fs
            .read(self.inos[name], 0, &mut buf)
            .map_err(|e| format!("read {name}: {e}"))?;
        if buf[..n] != want[..] {
            return Err(format!(
                "live read of {}/{name}: {n} bytes, expected {} (content differs)",
                self.dir,
                want.len()
            ));
        }
        Ok(())
    }

    fn pick(&self, rng: &mut StdRng, not: Option<&str>) -> Option<String> {
        let names: Vec<&String> = self
            .cur()
            .keys()
            .filter(|n| Some(n.as_str()) != not)
            .collect();
        (!names.is_empty()).then(|| names[rng.gen_range(0..names.len())].clone())
    }

    fn run(&mut self, ctx: &Ctx<'_>, rng: &mut StdRng) -> Result<(), String> {
        for _ in 0..ctx.spec.iters {
            match ctx.spec.shape {
                Shape::FsMark => {
                    let f = self.create(ctx, rng)?;
                    self.append(ctx, rng, &f)?;
                    self.fsync(ctx, rng, Some(&f))?;
                }
                Shape::VarmailShared | Shape::VarmailSplit => {
                    let n = self.cur().len();
                    if n >= ctx.spec.max_files || (n > 1 && rng.gen_bool(0.3)) {
                        if let Some(v) = self.pick(rng, None) {
                            self.unlink(ctx, &v)?;
                        }
                    }
                    let f = self.create(ctx, rng)?;
                    self.append(ctx, rng, &f)?;
                    self.fsync(ctx, rng, Some(&f))?;
                    if let Some(g) = self.pick(rng, Some(&f)) {
                        self.append(ctx, rng, &g)?;
                        self.fsync(ctx, rng, Some(&g))?;
                    }
                    if let Some(r) = self.pick(rng, None) {
                        self.read(ctx, &r)?;
                    }
                    if rng.gen_bool(0.15) {
                        self.fsync(ctx, rng, None)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Run `spec` with `seed` on a copy of `base` (mounted with `opts`) and record it.
/// The directories are made and synced first; then every thread runs with its
/// own RNG seeded from `seed` and its index, so what each thread does is
/// deterministic (how the threads interleave is not).
pub fn record_conc(
    spec: &'static ConcSpec,
    base: &[u8],
    seed: u64,
    opts: MountOptions,
) -> Result<ConcRecording, String> {
    // A flush takes a while, as on a real device, and so does a write: fsyncs
    // and commits overlap them.
    let dev = Arc::new(
        RecordingDevice::new(base.to_vec())
            .with_flush_latency(FLUSH_LATENCY)
            .with_write_latency(WRITE_LATENCY),
    );
    let per_file = opts.data_order == commitfs_fs::DataOrder::File;
    let fs = Fs::open(dev.clone(), opts).map_err(|e| format!("mount of the base image: {e}"))?;
    let bs = fs.block_size() as usize;
    let mut dirs: Vec<(String, Ino)> = Vec::new();
    let names: Vec<String> = match spec.shape {
        Shape::VarmailShared => vec!["shared".into()],
        _ => (0..spec.threads).map(|t| format!("t{t}")).collect(),
    };
    for n in names {
        let a = fs
            .mkdir(ROOT_INO, n.as_bytes(), 0o755, 0, 0)
            .map_err(|e| format!("mkdir /{n}: {e}"))?;
        dirs.push((format!("/{n}"), a.ino));
    }
    fs.sync().map_err(|e| format!("sync after setup: {e}"))?;
    let flushes0 = fs.io_stats().flushes;
    let workload_start = dev.op_count();
    let clock = AtomicU64::new(0);
    let ctx = Ctx {
        fs: &fs,
        dev: &dev,
        clock: &clock,
        spec,
        bs,
    };
    let results: Vec<Result<ThreadRec, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..spec.threads)
            .map(|t| {
                let (dir, dir_ino) = dirs[t % dirs.len()].clone();
                let ctx = &ctx;
                s.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed ^ ((t as u64 + 1) * 0xA24B_AED4));
                    let mut b = Builder {
                        t,
                        dir: dir.clone(),
                        dir_ino,
                        rec: ThreadRec {
                            dir,
                            states: vec![Arc::new(BTreeMap::new())],
                            ops: Vec::new(),
                            acks: Vec::new(),
                            fsyncs: 0,
                        },
                        inos: HashMap::new(),
                        last_on: HashMap::new(),
                        last_dir: 0,
                        files: 0,
                        version: 0,
                    };
                    b.run(ctx, &mut rng)
                        .map_err(|e| format!("thread {t}: {e}"))?;
                    Ok(b.rec)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("workload thread panicked".into()))
            })
            .collect()
    });
    let threads = results.into_iter().collect::<Result<Vec<_>, String>>()?;
    let flushes = fs.io_stats().flushes - flushes0;
    let js = fs.stats().journal;
    let unmount_start = dev.op_count();
    // The live tree must match the models before any crash is considered.
    {
        let obs = observe::observe(&fs, spec.max_file_blocks * bs as u64)?;
        let dirnames: Vec<String> = dirs.iter().map(|d| d.0.clone()).collect();
        let per = split_by_thread(&obs, &dirnames, &threads)?;
        for (t, files) in per.iter().enumerate() {
            let want = threads[t].states.last().expect("states");
            state_matches(want, files).map_err(|e| {
                format!("live tree differs from thread {t}'s model before any crash: {e}")
            })?;
        }
    }
    fs.unmount().map_err(|e| format!("unmount: {e}"))?;
    drop(fs);
    let log = dev
        .crash_log()
        .with_atomic(vec![crate::workload::superblock_range()]);
    let inflight = inflight::analyze(&log, bs);
    let commit_blocks = crate::jlog::journal_blocks(&log, bs, log.len())
        .into_iter()
        .filter(|b| b.blocktype == jbd2::BLOCKTYPE_COMMIT)
        .map(|b| (b.log_idx, b.offset, b.seq))
        .collect();
    Ok(ConcRecording {
        spec,
        seed,
        bs,
        dirs: dirs.into_iter().map(|d| d.0).collect(),
        log,
        threads,
        workload_start,
        unmount_start,
        fast_commits: js.fc_commits,
        full_commits: js.commits,
        flushes,
        inflight,
        commit_blocks,
        per_file,
    })
}

/// An observed file: metadata and content.
type ObsFile<'a> = (&'a crate::model::Meta, &'a [u8]);

/// Group the observed regular files by the thread whose name they carry, and
/// check the directories: exactly the root and the workload's directories, with
/// their link counts; every file named `t<thread>f<n>` in its thread's directory.
fn split_by_thread<'a>(
    obs: &'a Observed,
    dirs: &[String],
    threads: &[ThreadRec],
) -> Result<Vec<BTreeMap<String, ObsFile<'a>>>, String> {
    let mut per: Vec<BTreeMap<String, ObsFile<'a>>> = vec![BTreeMap::new(); threads.len()];
    let mut seen_dirs = BTreeSet::new();
    for (path, ino) in &obs.paths {
        let (meta, content) = &obs.inodes[ino];
        if meta.kind == Kind::Dir {
            let want_nlink = if path == "/" {
                3 + dirs.len() as u32
            } else {
                2
            };
            if path != "/" && !dirs.contains(path) {
                return Err(format!("(a) unexpected directory {path}"));
            }
            if meta.nlink != want_nlink || !meta.xattrs.is_empty() {
                return Err(format!(
                    "(a) directory {path}: nlink {} (want {want_nlink}), {} xattrs",
                    meta.nlink,
                    meta.xattrs.len()
                ));
            }
            seen_dirs.insert(path.clone());
            continue;
        }
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path));
        let t = name
            .strip_prefix('t')
            .and_then(|r| r.split_once('f'))
            .and_then(|(t, _)| t.parse::<usize>().ok())
            .filter(|&t| t < threads.len())
            .ok_or_else(|| format!("(a) unexpected entry {path} ({:?})", meta.kind))?;
        if threads[t].dir != parent {
            return Err(format!("(a) {path} is outside thread {t}'s directory"));
        }
        per[t].insert(name.to_string(), (meta, &content[..]));
    }
    for d in dirs {
        if !seen_dirs.contains(d) {
            return Err(format!("(a) directory {d} is missing"));
        }
    }
    Ok(per)
}

/// Whether observed files equal a thread state exactly; the first difference.
fn state_matches(
    want: &BTreeMap<String, FileState>,
    got: &BTreeMap<String, ObsFile<'_>>,
) -> Result<(), String> {
    for name in want.keys() {
        if !got.contains_key(name) {
            return Err(format!("missing {name}"));
        }
    }
    for (name, (meta, content)) in got {
        let Some(w) = want.get(name) else {
            return Err(format!("unexpected {name}"));
        };
        if meta.kind != Kind::File
            || meta.perm != w.perm
            || meta.nlink != 1
            || !meta.xattrs.is_empty()
        {
            return Err(format!(
                "{name}: {:?} perm {:o} nlink {} ({} xattrs), want a file, perm {:o}, nlink 1",
                meta.kind,
                meta.perm,
                meta.nlink,
                meta.xattrs.len(),
                w.perm
            ));
        }
        if meta.size != w.data.len() as u64 {
            return Err(format!("{name}: size {} != {}", meta.size, w.data.len()));
        }
        if *content != &w.data[..] {
            let i = content
                .iter()
                .zip(w.data.iter())
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(format!(
                "(c) {name}: byte {i} is {:#04x}, model {:#04x} (stale or foreign data)",
                content[i], w.data[i]
            ));
        }
    }
    Ok(())
}

/// What a passing state showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConcPass {
    /// Recovered prefix of each thread (the smallest that matched).
    pub prefixes: Vec<usize>,
    /// Recovery stopped before a transaction whose commit block survived.
    pub successor_durable: bool,
    /// JBD2 transactions recovery replayed.
    pub replayed: u32,
}

/// (e): the replayed transactions are a contiguous run, each with a commit block
/// the recording wrote before `k` and the image holds; whether a later commit
/// block survived too.
fn check_log(rec: &ConcRecording, img: &[u8], k: usize) -> Result<(u32, bool), String> {
    let Some(r) = crate::jlog::jbd2_report(img)? else {
        return Ok((0, false));
    };
    let run = r.end_tid.wrapping_sub(r.start_tid);
    if r.transactions != run {
        return Err(format!(
            "(e) recovery replays {} transactions for the tid run {}..{}",
            r.transactions, r.start_tid, r.end_tid
        ));
    }
    // A commit block counts when its first sector (the header) is in the image:
    // the rest of a plain commit block is zeros, and recovery accepts a block
    // torn after its header, as the kernel does (`Commit::header_ok`).
    let head = 512.min(rec.bs);
    let present = |&(idx, off, _): &(usize, u64, u32)| -> bool {
        idx < k
            && match &rec.log.ops()[idx] {
                LogOp::Write { offset, data, .. } => {
                    let s = (off - offset) as usize;
                    let o = off as usize;
                    img.get(o..o + head) == data.get(s..s + head)
                }
                LogOp::Flush => false,
            }
    };
    for i in 0..run {
        let tid = r.start_tid.wrapping_add(i);
        if !rec.commit_blocks.iter().any(|c| c.2 == tid && present(c)) {
            return Err(format!(
                "(e) recovery replays tid {tid} ({}..{}) but no commit block of it written before the crash point is in the image",
                r.start_tid, r.end_tid
            ));
        }
    }
    let successor = rec
        .commit_blocks
        .iter()
        .any(|c| c.2.wrapping_sub(r.end_tid) < 1 << 16 && present(c));
    Ok((run, successor))
}

/// Check one crash image of a concurrent recording at crash point `k`; hands the
/// image buffer back for reuse.
pub fn check_conc_image(
    rec: &ConcRecording,
    img: Vec<u8>,
    k: usize,
    scratch: &ScratchFile,
) -> (Result<ConcPass, String>, Option<Vec<u8>>) {
    let (replayed, successor_durable) = match check_log(rec, &img, k) {
        Ok(x) => x,
        Err(e) => return (Err(e), Some(img)),
    };
    let dev = Arc::new(commitfs_device::MemDevice::from_vec(img));
    let r = (|| {
        let fs = Fs::open(dev.clone(), mount_opts()).map_err(|e| format!("mount/recovery: {e}"))?;
        let obs = observe::observe(&fs, rec.spec.max_file_blocks * rec.bs as u64)
            .map_err(|e| format!("(a) {e}"))?;
        let prefixes = match_threads(rec, &obs, k)?;
        fs.unmount()
            .map_err(|e| format!("unmount after recovery: {e}"))?;
        Ok(prefixes)
    })();
    let Ok(dev) = Arc::try_unwrap(dev) else {
        return (Err("device still referenced after unmount".into()), None);
    };
    let recovered = dev.into_vec();
    let prefixes = match r {
        Ok(p) => p,
        Err(e) => return (Err(e), Some(recovered)),
    };
    if let Err(e) = fsck_image(&recovered, scratch, "after recovery") {
        return (Err(format!("(d) {e}")), Some(recovered));
    }
    (
        Ok(ConcPass {
            prefixes,
            successor_durable,
            replayed,
        }),
        Some(recovered),
    )
}

/// (a), (b), (c), (f): each thread's recovered files are a prefix of its
/// operations within its window, and the prefixes respect real-time order.
pub fn match_threads(rec: &ConcRecording, obs: &Observed, k: usize) -> Result<Vec<usize>, String> {
    let per = split_by_thread(obs, &rec.dirs, &rec.threads)?;
    let mut cands: Vec<(usize, usize)> = Vec::with_capacity(rec.threads.len());
    for (t, (tr, got)) in rec.threads.iter().zip(&per).enumerate() {
        let (lo, hi) = tr.window(k);
        let ok: Vec<usize> = (lo..=hi)
            .filter(|&p| state_matches(&tr.states[p], got).is_ok())
            .collect();
        match (ok.first(), ok.last()) {
            (Some(&a), Some(&b)) => cands.push((a, b)),
            _ => {
                let older = (0..lo)
                    .rev()
                    .find(|&p| state_matches(&tr.states[p], got).is_ok());
                let why = |p: usize| state_matches(&tr.states[p], got).err().unwrap_or_default();
                let ack = tr
                    .acks
                    .iter()
                    .filter(|a| a.ret_idx <= k && a.covers == lo)
                    .map(|a| a.what.as_str())
                    .next()
                    .unwrap_or("-");
                return Err(format!(
                    "(b) thread {t}: recovered files are no prefix in [{lo}, {hi}] of its {} operations{}; vs {lo}: {}; vs {hi}: {}; last acknowledged: {ack}",
                    tr.ops.len(),
                    older.map_or(String::new(), |p| format!(
                        " (they equal prefix {p}: acknowledged operations lost)"
                    )),
                    why(lo),
                    why(hi),
                ));
            }
        }
    }
    // (f) An operation that returned before a surviving one began survived too.
    for (t, tr) in rec.threads.iter().enumerate() {
        let p = cands[t].0;
        if p == 0 {
            continue;
        }
        let y = &tr.ops[p - 1];
        for (u, ur) in rec.threads.iter().enumerate() {
            if u == t {
                continue;
            }
            let mut need = ur.ops.partition_point(|o| o.end_seq < y.start_seq);
            if rec.per_file {
                // data_order=file: an append is ordered before later operations
                // of other threads only through its own file's fsync (which
                // comes right after it in every shape, before the thread's next
                // operation), so a trailing append may be missing.
                while need > 0 && ur.ops[need - 1].desc.starts_with("append ") {
                    need -= 1;
                }
            }
            if cands[u].1 < need {
                return Err(format!(
                    "(f) thread {t}'s `{}` survived but thread {u}'s `{}`, which returned before it began, did not (thread {u} recovered at most {} of its operations)",
                    y.desc,
                    ur.ops[need - 1].desc,
                    cands[u].1
                ));
            }
        }
    }
    Ok(cands.into_iter().map(|c| c.0).collect())
}

/// Options of one concurrent harness run.
#[derive(Debug, Clone)]
pub struct ConcConfig {
    pub workload: String,
    pub states: usize,
    pub seed: u64,
    pub torn: bool,
    pub block_size: u32,
    pub workers: usize,
    pub fast_commit: bool,
    pub fc_data_csum: bool,
    /// Record under `data_order=file` (check (f) then lets an append wait
    /// for its own fsync; not with `fc_data_csum`, which refuses it).
    pub data_order_file: bool,
    /// Share of the states cut where the most transactions are in flight (the
    /// rest as [`crate::plan_states`] picks them).
    pub inflight_share: f64,
    pub save_failures: Option<PathBuf>,
}

impl Default for ConcConfig {
    fn default() -> Self {
        ConcConfig {
            workload: "varmail-shared-8".into(),
            states: 200,
            seed: 1,
            torn: true,
            block_size: 1024,
            workers: 0,
            fast_commit: false,
            fc_data_csum: false,
            data_order_file: false,
            inflight_share: 0.3,
            save_failures: std::env::var_os("CRASHTEST_SAVE_FAILURES").map(Into::into),
        }
    }
}

/// Outcome of a concurrent run.
#[derive(Debug, Clone)]
pub struct ConcSummary {
    pub workload: String,
    pub mode: &'static str,
    pub block_size: u32,
    pub seed: u64,
    pub ops: usize,
    pub fsyncs: usize,
    pub log_len: usize,
    pub flushes: u64,
    pub fast_commits: u64,
    pub full_commits: u64,
    pub inflight: String,
    pub inflight_max: usize,
    pub states: usize,
    pub torn_states: usize,
    /// Checked states with at least [`MIN_INFLIGHT`] units in flight, and the most
    /// in flight in any checked state.
    pub states_min_inflight: usize,
    pub checked_inflight_max: usize,
    /// States where recovery stopped before a surviving later commit block.
    pub successor_durable_states: usize,
    /// Distinct recovered prefix vectors (recovery really varied).
    pub distinct_outcomes: usize,
    pub passed: usize,
    pub failures: Vec<(CrashSpec, String)>,
    pub record_time: Duration,
    pub check_time: Duration,
}

impl std::fmt::Display for ConcSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "crashtest-conc workload={} mode={} states={} passed={} failed={} bs={} seed={} torn={} ops={} fsyncs={} log={} flushes={} flushes_per_fsync={:.2} fast_commits={} full_commits={} {} checked_states_inflight>={}={} checked_inflight_max={} successor_durable_states={} outcomes={} record={:.2}s check={:.2}s",
            self.workload,
            self.mode,
            self.states,
            self.passed,
            self.failures.len(),
            self.block_size,
            self.seed,
            self.torn_states,
            self.ops,
            self.fsyncs,
            self.log_len,
            self.flushes,
            self.flushes as f64 / self.fsyncs.max(1) as f64,
            self.fast_commits,
            self.full_commits,
            self.inflight,
            MIN_INFLIGHT,
            self.states_min_inflight,
            self.checked_inflight_max,
            self.successor_durable_states,
            self.distinct_outcomes,
            self.record_time.as_secs_f64(),
            self.check_time.as_secs_f64()
        )
    }
}

impl ConcSummary {
    pub fn failure_report(&self, n: usize) -> String {
        self.failures
            .iter()
            .take(n)
            .map(|(s, m)| {
                format!(
                    "k={} seed={:#x} keep={}/256 torn={}: {m}",
                    s.k, s.seed, s.keep_256, s.torn
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The mode name of a configuration.
pub fn mode_name(fast_commit: bool, fc_data_csum: bool) -> &'static str {
    match (fast_commit, fc_data_csum) {
        (_, true) => "fc_data_csum",
        (true, false) => "fast_commit",
        _ => "jbd2",
    }
}

/// How long a flush of a concurrent recording takes to be acknowledged.
pub const FLUSH_LATENCY: std::time::Duration = std::time::Duration::from_micros(500);

/// How long a write of a concurrent recording takes to complete (an SSD's
/// 4 KiB write is some tens of µs).
pub const WRITE_LATENCY: std::time::Duration = std::time::Duration::from_micros(20);

/// Record a concurrent workload as `cfg` says (image made with `-O fast_commit`
/// for the fast-commit modes).
pub fn record_for(cfg: &ConcConfig) -> Result<ConcRecording, String> {
    let spec = find_conc(&cfg.workload).ok_or_else(|| {
        format!(
            "unknown concurrent workload {:?} (known: {})",
            cfg.workload,
            CONC_WORKLOADS
                .iter()
                .map(|w| w.name)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let base = crate::base_image_with(cfg.block_size, cfg.fast_commit || cfg.fc_data_csum)?;
    let opts = MountOptions {
        fc_data_csum: cfg.fc_data_csum,
        data_order: if cfg.data_order_file {
            commitfs_fs::DataOrder::File
        } else {
            commitfs_fs::DataOrder::Prefix
        },
        ..crate::record_options()
    };
    record_conc(spec, &base, cfg.seed, opts)
}

/// Crash points of a concurrent recording: `n` states, a share of them where the
/// most units are in flight (at least [`MIN_INFLIGHT`] when the recording has such
/// points), the rest from [`crate::plan_states`]. Sorted by crash point.
pub fn plan_conc_states(
    rec: &ConcRecording,
    n: usize,
    share: f64,
    seed: u64,
    torn: bool,
) -> Vec<CrashSpec> {
    let extra = ((n as f64) * share) as usize;
    let mut out = crate::plan_states(&rec.log, n - extra, seed, torn);
    let want = MIN_INFLIGHT.min(rec.inflight.max()).max(1);
    let pts = rec.inflight.points_with(want);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x1F11_6473);
    if !pts.is_empty() {
        for _ in 0..extra {
            out.push(CrashSpec {
                k: pts[rng.gen_range(0..pts.len())],
                seed: rng.gen(),
                keep_256: match rng.gen_range(0..3) {
                    0 => 255,
                    _ => rng.gen(),
                },
                torn: torn && rng.gen_bool(0.5),
            });
        }
    }
    // The directories exist from the setup's sync on: crash earlier and there is
    // nothing concurrent to check.
    for s in &mut out {
        s.k = s.k.max(rec.workload_start);
    }
    out.sort_by_key(|s| (s.k, s.seed));
    out
}

/// Record `cfg.workload` and check its crash states.
pub fn run_conc(cfg: &ConcConfig) -> Result<ConcSummary, String> {
    let t0 = Instant::now();
    let rec = record_for(cfg)?;
    let record_time = t0.elapsed();
    let states = plan_conc_states(&rec, cfg.states, cfg.inflight_share, cfg.seed, cfg.torn);
    let t1 = Instant::now();
    let results = check_conc_states(&rec, &states, cfg.workers, cfg.save_failures.as_deref());
    let check_time = t1.elapsed();
    let mut failures = Vec::new();
    let mut outcomes = BTreeSet::new();
    let mut successor = 0;
    for (s, r) in states.iter().zip(results) {
        match r {
            Ok(p) => {
                successor += usize::from(p.successor_durable);
                outcomes.insert(p.prefixes);
            }
            Err(m) => failures.push((*s, m)),
        }
    }
    let at: Vec<usize> = states.iter().map(|s| rec.inflight.at(s.k)).collect();
    Ok(ConcSummary {
        workload: rec.spec.name.into(),
        mode: mode_name(cfg.fast_commit, cfg.fc_data_csum),
        block_size: cfg.block_size,
        seed: cfg.seed,
        ops: rec.ops(),
        fsyncs: rec.fsyncs(),
        log_len: rec.log.len(),
        flushes: rec.flushes,
        fast_commits: rec.fast_commits,
        full_commits: rec.full_commits,
        inflight: rec.inflight.describe(),
        inflight_max: rec.inflight.max(),
        states: states.len(),
        torn_states: states.iter().filter(|s| s.torn).count(),
        states_min_inflight: at.iter().filter(|&&n| n >= MIN_INFLIGHT).count(),
        checked_inflight_max: at.iter().copied().max().unwrap_or(0),
        successor_durable_states: successor,
        distinct_outcomes: outcomes.len(),
        passed: states.len() - failures.len(),
        failures,
        record_time,
        check_time,
    })
}

/// Check `states` (sorted by crash point) on `workers` threads (0 = one per CPU).
pub fn check_conc_states(
    rec: &ConcRecording,
    states: &[CrashSpec],
    workers: usize,
    save: Option<&std::path::Path>,
) -> Vec<Result<ConcPass, String>> {
    crate::for_each_state(
        &rec.log,
        states,
        workers,
        "conc",
        |mat, spec, scratch, buf| {
            mat.image_into(spec, buf);
            let img = std::mem::take(buf);
            let keep = save.map(|_| img.clone());
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let (r, back) = check_conc_image(rec, img, spec.k, scratch);
                (r, back)
            }));
            let r = match r {
                Ok((r, back)) => {
                    if let Some(b) = back {
                        *buf = b;
                    }
                    r
                }
                Err(p) => Err(format!(
                    "panic during check: {}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                )),
            };
            if let (Err(m), Some(dir), Some(img)) = (&r, save, keep) {
                let stem = format!(
                    "{}-bs{}-seed{}-k{}-s{:016x}",
                    rec.spec.name, rec.bs, rec.seed, spec.k, spec.seed
                );
                let _ = std::fs::create_dir_all(dir)
                    .and_then(|_| std::fs::write(dir.join(format!("{stem}.img")), &img))
                    .and_then(|_| std::fs::write(dir.join(format!("{stem}.txt")), m));
            }
            r
        },
    )
}
