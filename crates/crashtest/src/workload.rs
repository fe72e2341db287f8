//! Workloads: seeded mixes of namespace, data and xattr operations with fsync,
//! fsyncdir and sync at random points, run on a [`RecordingDevice`] while a model
//! records the tree after every completed operation.
//!
//! Mutating operations run under one workload-level mutex (the fs call and the
//! model update together), so the model's order is the file system's order.
//! fsync/fsyncdir/sync run outside it: their commits race with other threads'
//! operations, which is the concurrency a journal must get right.

use std::collections::HashMap;
use std::sync::Arc;

use commitfs_device::{CrashLog, RecordingDevice};
use commitfs_fs::{FallocFlags, Fs, Ino, MountOptions, RenameFlags, SetAttr, XattrFlags, ROOT_INO};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::model::{self, content_of, FileId, Kind, Model, Tree, ROOT_ID};
use crate::observe;

/// Operation kinds a workload can draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Create,
    Append,
    Overwrite,
    TruncDown,
    TruncUp,
    Fallocate,
    FallocKeep,
    Punch,
    Rename,
    Exchange,
    Link,
    Unlink,
    Mkdir,
    Rmdir,
    Symlink,
    SetXattr,
    RemoveXattr,
    Chmod,
    Fsync,
    Fsyncdir,
    Sync,
}

/// A named workload.
#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    pub name: &'static str,
    pub about: &'static str,
    pub threads: usize,
    pub ops_per_thread: usize,
    pub weights: &'static [(Op, u32)],
    /// Largest file, in blocks.
    pub max_file_blocks: u64,
    /// Largest single write, in blocks.
    pub max_write_blocks: u64,
    /// Directory depth limit below a thread's home.
    pub max_depth: usize,
}

const MIXED: &[(Op, u32)] = &[
    (Op::Create, 10),
    (Op::Append, 12),
    (Op::Overwrite, 10),
    (Op::TruncDown, 4),
    (Op::TruncUp, 3),
    (Op::Fallocate, 2),
    (Op::FallocKeep, 3),
    (Op::Punch, 3),
    (Op::Rename, 6),
    (Op::Exchange, 2),
    (Op::Link, 3),
    (Op::Unlink, 5),
    (Op::Mkdir, 4),
    (Op::Rmdir, 2),
    (Op::Symlink, 3),
    (Op::SetXattr, 5),
    (Op::RemoveXattr, 2),
    (Op::Chmod, 2),
    (Op::Fsync, 6),
    (Op::Fsyncdir, 3),
    (Op::Sync, 1),
];

const DATA: &[(Op, u32)] = &[
    (Op::Create, 3),
    (Op::Append, 14),
    (Op::Overwrite, 16),
    (Op::TruncDown, 5),
    (Op::TruncUp, 5),
    (Op::Fallocate, 3),
    (Op::FallocKeep, 5),
    (Op::Punch, 6),
    (Op::Unlink, 1),
    (Op::Fsync, 10),
    (Op::Sync, 1),
];

const NAMESPACE: &[(Op, u32)] = &[
    (Op::Create, 14),
    (Op::Append, 3),
    (Op::Rename, 12),
    (Op::Exchange, 3),
    (Op::Link, 7),
    (Op::Unlink, 9),
    (Op::Mkdir, 8),
    (Op::Rmdir, 5),
    (Op::Symlink, 6),
    (Op::Chmod, 2),
    (Op::Fsync, 3),
    (Op::Fsyncdir, 7),
    (Op::Sync, 1),
];

const XATTR: &[(Op, u32)] = &[
    (Op::Create, 6),
    (Op::Mkdir, 2),
    (Op::Append, 3),
    (Op::SetXattr, 20),
    (Op::RemoveXattr, 8),
    (Op::Chmod, 4),
    (Op::Unlink, 3),
    (Op::Rename, 2),
    (Op::Fsync, 7),
    (Op::Fsyncdir, 2),
];

/// Many small transactions: every third operation is an fsync, so the log wraps
/// and checkpoints happen inside the recorded run.
const CHURN: &[(Op, u32)] = &[
    (Op::Create, 8),
    (Op::Append, 8),
    (Op::Overwrite, 4),
    (Op::Unlink, 5),
    (Op::Rename, 3),
    (Op::Mkdir, 2),
    (Op::Rmdir, 2),
    (Op::SetXattr, 2),
    (Op::TruncDown, 2),
    (Op::Fsync, 14),
    (Op::Fsyncdir, 4),
];

/// Commits racing with metadata changes: half the steps are fsyncs, the rest
/// small operations on shared metadata blocks (inode tables, bitmaps, directories).
const MTSYNC: &[(Op, u32)] = &[
    (Op::Create, 8),
    (Op::Append, 4),
    (Op::SetXattr, 6),
    (Op::Chmod, 6),
    (Op::Rename, 4),
    (Op::Link, 2),
    (Op::Unlink, 4),
    (Op::Mkdir, 2),
    (Op::TruncDown, 2),
    (Op::Fsync, 18),
    (Op::Fsyncdir, 6),
    (Op::Sync, 2),
];

pub const WORKLOADS: &[WorkloadSpec] = &[
    WorkloadSpec {
        name: "mixed",
        about: "every operation kind, fsync/fsyncdir/sync at random points",
        threads: 1,
        ops_per_thread: 300,
        weights: MIXED,
        max_file_blocks: 40,
        max_write_blocks: 6,
        max_depth: 3,
    },
    WorkloadSpec {
        name: "data",
        about: "appends, overwrites, truncates, fallocate and punch on a few files",
        threads: 1,
        ops_per_thread: 300,
        weights: DATA,
        max_file_blocks: 64,
        max_write_blocks: 8,
        max_depth: 1,
    },
    WorkloadSpec {
        name: "namespace",
        about: "create, rename, exchange, link, unlink, mkdir, rmdir, symlink, fsyncdir",
        threads: 1,
        ops_per_thread: 300,
        weights: NAMESPACE,
        max_file_blocks: 8,
        max_write_blocks: 2,
        max_depth: 4,
    },
    WorkloadSpec {
        name: "xattr",
        about: "setxattr/removexattr (in-inode and block), chmod, with fsync",
        threads: 1,
        ops_per_thread: 250,
        weights: XATTR,
        max_file_blocks: 8,
        max_write_blocks: 2,
        max_depth: 2,
    },
    WorkloadSpec {
        name: "churn",
        about: "small transactions, fsync every few operations: log wrap and checkpoints",
        threads: 1,
        ops_per_thread: 900,
        weights: CHURN,
        max_file_blocks: 16,
        max_write_blocks: 4,
        max_depth: 2,
    },
    WorkloadSpec {
        name: "mt4",
        about: "4 threads of the mixed workload; commits race with other threads' operations",
        threads: 4,
        ops_per_thread: 100,
        weights: MIXED,
        max_file_blocks: 24,
        max_write_blocks: 4,
        max_depth: 2,
    },
    WorkloadSpec {
        name: "mtsync",
        about: "4 threads, half the steps fsyncs racing small metadata changes",
        threads: 4,
        ops_per_thread: 150,
        weights: MTSYNC,
        max_file_blocks: 8,
        max_write_blocks: 2,
        max_depth: 2,
    },
];

pub fn find(name: &str) -> Option<&'static WorkloadSpec> {
    WORKLOADS.iter().find(|w| w.name == name)
}

/// An acknowledged fsync, fsyncdir, sync or unmount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncRecord {
    /// Model snapshot index when it started: everything up to it must survive.
    pub model_idx: usize,
    /// Device-log length when it started.
    pub start_idx: usize,
    /// Device-log length when it returned: crash points `k >= ret_idx` come after.
    pub ret_idx: usize,
    pub what: String,
    /// An fdatasync of this file: it promises the file's data and size as of
    /// `model_idx`, not the rest of the tree (C.5; ext4's fdatasync).
    pub data_of: Option<FileId>,
    /// The regular file an fsync or fdatasync was for (under
    /// `data_order=file` its data is the only data the fsync promises).
    pub file: Option<FileId>,
    /// A sync or unmount: every file's data as of `model_idx`.
    pub whole: bool,
}

/// Everything one recorded run produced.
pub struct Recording {
    pub workload: &'static str,
    pub seed: u64,
    pub bs: usize,
    pub log: CrashLog,
    /// `snaps[i]`: the tree after `i` operations.
    pub snaps: Vec<Tree>,
    pub snap_hashes: Vec<u64>,
    /// `op_start[i]`: device-log length when operation `i` (giving `snaps[i + 1]`)
    /// started.
    pub op_start: Vec<usize>,
    pub op_desc: Vec<String>,
    pub syncs: Vec<SyncRecord>,
    /// Where the final clean unmount started in the log.
    pub unmount_start: usize,
    pub max_file_size: u64,
    /// Fast commits and full JBD2 commits written before the final unmount.
    pub fast_commits: u64,
    pub full_commits: u64,
    /// fdatasyncs that committed nothing (C.5): their promise is the checker's
    /// per-file rule, not a whole-tree point.
    pub data_only_fdatasyncs: u64,
    /// Recorded under `data_order=file`: the tree is still a prefix of the
    /// operations, but each file's size and data only as of its own last
    /// fsync (the checker's per-file rule, check.rs).
    pub per_file: bool,
}

impl Recording {
    /// `(lo, hi)` for crash point `k`: the recovered tree must be a snapshot `j`
    /// with `lo <= j <= hi`; `lo` is the latest acknowledged sync's start, `hi` the
    /// number of operations started before `k`.
    pub fn window(&self, k: usize) -> (usize, usize) {
        let lo = self
            .syncs
            .iter()
            .filter(|s| s.ret_idx <= k && s.data_of.is_none())
            .map(|s| s.model_idx)
            .max()
            .unwrap_or(0);
        let hi = self.op_start.partition_point(|&s| s < k);
        (lo, hi.max(lo))
    }

    /// The fdatasyncs acknowledged before crash point `k`: `(file, snapshot)`,
    /// the file's data and size as of that snapshot must have survived.
    pub fn data_syncs(&self, k: usize) -> Vec<(FileId, usize)> {
        self.syncs
            .iter()
            .filter(|s| s.ret_idx <= k)
            .flat_map(|s| {
                let own = s
                    .data_of
                    .or(s.file.filter(|_| self.per_file))
                    .map(|f| (f, s.model_idx));
                // data_order=file: a sync promises every file's data.
                let all = (self.per_file && s.whole).then(|| {
                    self.snaps[s.model_idx]
                        .inodes
                        .iter()
                        .filter(|(_, i)| i.meta.kind == Kind::File)
                        .map(|(&f, _)| (f, s.model_idx))
                });
                own.into_iter().chain(all.into_iter().flatten())
            })
            .collect()
    }
}

struct Shared {
    model: Model,
    inos: HashMap<FileId, Ino>,
    snaps: Vec<Tree>,
    op_start: Vec<usize>,
    op_desc: Vec<String>,
    syncs: Vec<SyncRecord>,
    names: u64,
}

struct Ctx<'a> {
    spec: &'a WorkloadSpec,
    fs: &'a Fs,
    dev: &'a RecordingDevice,
    shared: &'a std::sync::Mutex<Shared>,
    bs: usize,
}

const PERMS: &[u16] = &[0o644, 0o600, 0o755, 0o640, 0o444, 0o4755];
const DIR_PERMS: &[u16] = &[0o755, 0o700, 0o750, 0o1777];
const XATTR_NAMES: &[&str] = &["user.a", "user.bb", "user.long_attribute_name", "trusted.t"];

fn lock(m: &std::sync::Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The mount options of a recording: read-write, no periodic commits (every
/// commit comes from the workload), fast commits on where the image has them.
pub fn record_options() -> MountOptions {
    MountOptions {
        read_only: false,
        commit_interval: 0,
        ..Default::default()
    }
}

/// Run `spec` with `seed` on a copy of `base` and record everything.
pub fn record(spec: &'static WorkloadSpec, base: &[u8], seed: u64) -> Result<Recording, String> {
    record_with(spec, base, seed, record_options())
}

/// [`record`] with the workload's file system mounted with `opts` (e.g.
/// `fc_data_csum`); recovery of the crash states always mounts with defaults.
pub fn record_with(
    spec: &'static WorkloadSpec,
    base: &[u8],
    seed: u64,
    opts: MountOptions,
) -> Result<Recording, String> {
    let dev = Arc::new(RecordingDevice::new(base.to_vec()));
    let per_file = opts.data_order == commitfs_fs::DataOrder::File;
    let fs = Fs::open(dev.clone(), opts).map_err(|e| format!("mount of the base image: {e}"))?;
    let bs = fs.block_size() as usize;
    let root = observe::observe(&fs, u64::MAX)?;
    let root_meta = root.inodes[&ROOT_INO].0.clone();
    let model = Model::new(bs, root_meta);
    let mut inos = HashMap::new();
    inos.insert(ROOT_ID, ROOT_INO);
    let shared = std::sync::Mutex::new(Shared {
        snaps: vec![model.tree.clone()],
        model,
        inos,
        op_start: Vec::new(),
        op_desc: Vec::new(),
        syncs: Vec::new(),
        names: 0,
    });
    let ctx = Ctx {
        spec,
        fs: &fs,
        dev: &dev,
        shared: &shared,
        bs,
    };
    let homes: Vec<String> = if spec.threads == 1 {
        vec!["/".into()]
    } else {
        (0..spec.threads)
            .map(|t| {
                let home = format!("/t{t}");
                ctx.mutate(|sh| {
                    let a = ctx
                        .fs
                        .mkdir(ROOT_INO, &home.as_bytes()[1..], 0o755, 0, 0)
                        .map_err(|e| format!("mkdir {home}: {e}"))?;
                    let id = sh.model.mkdir(&home, 0o755);
                    sh.inos.insert(id, a.ino);
                    Ok(Some(format!("mkdir {home}")))
                })?;
                Ok(home)
            })
            .collect::<Result<_, String>>()?
    };
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = homes
            .iter()
            .enumerate()
            .map(|(t, home)| {
                let ctx = &ctx;
                s.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed ^ ((t as u64 + 1) * 0x9E37_79B9));
                    for _ in 0..ctx.spec.ops_per_thread {
                        ctx.step(&mut rng, home)?;
                    }
                    Ok(())
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
    for r in results {
        r?;
    }
    let max_file_size = spec.max_file_blocks * bs as u64;
    // The live file system must match the model before any crash is considered.
    {
        let sh = lock(&shared);
        let obs = observe::observe(&fs, max_file_size)?;
        compare_exact(&sh.model.tree, &obs, bs)
            .map_err(|e| format!("live tree differs from the model before any crash: {e}"))?;
    }
    let js = fs.stats().journal;
    let data_only_fdatasyncs = fs.stats().fdatasyncs_data_only;
    let unmount_start = dev.op_count();
    fs.unmount().map_err(|e| format!("unmount: {e}"))?;
    let mut sh = shared.into_inner().unwrap_or_else(|e| e.into_inner());
    sh.syncs.push(SyncRecord {
        model_idx: sh.snaps.len() - 1,
        start_idx: unmount_start,
        ret_idx: dev.op_count(),
        what: "unmount".into(),
        data_of: None,
        file: None,
        whole: true,
    });
    drop(fs);
    let snap_hashes = sh
        .snaps
        .iter()
        .map(|t| model::canonical_hash(&t.canonical()))
        .collect();
    Ok(Recording {
        workload: spec.name,
        seed,
        bs,
        log: dev.crash_log().with_atomic(vec![superblock_range()]),
        snaps: sh.snaps,
        snap_hashes,
        op_start: sh.op_start,
        op_desc: sh.op_desc,
        syncs: sh.syncs,
        unmount_start,
        max_file_size,
        fast_commits: js.fc_commits,
        full_commits: js.commits,
        data_only_fdatasyncs,
        per_file,
    })
}

/// The ext4 primary superblock (1 KiB at byte 1024). Its checksum is in its last
/// sector and every update changes its first sector, so a write torn between the
/// two leaves a superblock no ext4 implementation mounts (the kernel refuses it and
/// e2fsck falls back to a backup). Torn-write states therefore keep it whole unless
/// asked otherwise (`Config::torn_superblock`).
pub fn superblock_range() -> std::ops::Range<u64> {
    let o = commitfs_format::superblock::SUPERBLOCK_OFFSET;
    o..o + commitfs_format::superblock::SUPERBLOCK_SIZE as u64
}

/// Exact comparison of a live tree with the model (metadata and every byte).
pub fn compare_exact(tree: &Tree, obs: &observe::Observed, bs: usize) -> Result<(), String> {
    let want = tree.canonical();
    let got = obs.canonical();
    if want != got {
        return Err(observe::diff(&want, &got));
    }
    for (p, id) in &tree.paths {
        let ino = &tree.inodes[id];
        if ino.meta.kind != Kind::File {
            continue;
        }
        let c = content_of(ino, bs);
        if obs.content(p) != Some(&c[..]) {
            return Err(format!("content of {p} differs"));
        }
    }
    Ok(())
}

impl Ctx<'_> {
    /// Run one mutating operation under the workload lock; `f` returns a
    /// description when it changed the tree, `None` when nothing applied.
    fn mutate(
        &self,
        f: impl FnOnce(&mut Shared) -> Result<Option<String>, String>,
    ) -> Result<(), String> {
        let mut sh = lock(self.shared);
        let start = self.dev.op_count();
        if let Some(desc) = f(&mut sh)? {
            sh.op_start.push(start);
            sh.op_desc.push(desc);
            let t = sh.model.tree.clone();
            sh.snaps.push(t);
        }
        Ok(())
    }

    fn step(&self, rng: &mut StdRng, home: &str) -> Result<(), String> {
        let total: u32 = self.spec.weights.iter().map(|w| w.1).sum();
        let mut r = rng.gen_range(0..total);
        let mut op = self.spec.weights[0].0;
        for &(o, w) in self.spec.weights {
            if r < w {
                op = o;
                break;
            }
            r -= w;
        }
        match op {
            Op::Fsync | Op::Fsyncdir | Op::Sync => self.sync_op(op, rng, home),
            _ => self.mutate(|sh| self.apply(sh, op, rng, home)),
        }
    }

    fn sync_op(&self, op: Op, rng: &mut StdRng, home: &str) -> Result<(), String> {
        let (target, id, start, what) = {
            let sh = lock(self.shared);
            let t = &sh.model.tree;
            let cands: Vec<&String> = t
                .paths
                .iter()
                .filter(|(p, id)| {
                    model::is_within(p, home)
                        && match op {
                            Op::Fsync => t.inodes[id].meta.kind == Kind::File,
                            _ => t.inodes[id].meta.kind == Kind::Dir,
                        }
                })
                .map(|(p, _)| p)
                .collect();
            let Some(p) = pick(rng, &cands) else {
                return Ok(());
            };
            let id = t.paths[p.as_str()];
            let ino = sh.inos[&id];
            (ino, id, sh.snaps.len() - 1, format!("{op:?} {p}"))
        };
        let mut what = what;
        let datasync = op == Op::Fsync && rng.gen_bool(0.3);
        if datasync {
            what = what.replacen("Fsync", "Fdatasync", 1);
        }
        let start_idx = self.dev.op_count();
        let r = match op {
            Op::Fsync => self.fs.fsync(target, datasync),
            Op::Fsyncdir => self.fs.fsyncdir(target),
            _ => self.fs.sync(),
        };
        r.map_err(|e| format!("{what}: {e}"))?;
        let ret = self.dev.op_count();
        lock(self.shared).syncs.push(SyncRecord {
            model_idx: start,
            start_idx,
            ret_idx: ret,
            what,
            data_of: datasync.then_some(id),
            file: (op == Op::Fsync).then_some(id),
            whole: op == Op::Sync,
        });
        Ok(())
    }

    fn fresh_name(&self, sh: &mut Shared, rng: &mut StdRng, prefix: &str) -> String {
        sh.names += 1;
        let mut n = format!("{prefix}{}", sh.names);
        // Some long names so directories grow past one block (and into htrees).
        if rng.gen_bool(0.25) {
            let len = rng.gen_range(20..120);
            while n.len() < len {
                n.push(char::from(b'a' + (n.len() % 26) as u8));
            }
        }
        n
    }

    fn apply(
        &self,
        sh: &mut Shared,
        op: Op,
        rng: &mut StdRng,
        home: &str,
    ) -> Result<Option<String>, String> {
        let bs = self.bs as u64;
        let max_size = self.spec.max_file_blocks * bs;
        let fs = self.fs;
        let t = &sh.model.tree;
        let within = |p: &str| model::is_within(p, home);
        let of_kind = |k: Option<Kind>| -> Vec<String> {
            t.paths
                .iter()
                .filter(|(p, id)| within(p) && k.is_none_or(|k| t.inodes[id].meta.kind == k))
                .map(|(p, _)| p.clone())
                .collect()
        };
        let depth = |p: &str| p[home.len()..].matches('/').count();
        let dirs: Vec<String> = of_kind(Some(Kind::Dir))
            .into_iter()
            .filter(|d| depth(d) < self.spec.max_depth)
            .collect();
        let files = of_kind(Some(Kind::File));
        let ino_of = |sh: &Shared, p: &str| sh.inos[&sh.model.tree.paths[p]];
        let err = |what: String| move |e: commitfs_fs::FsError| format!("{what}: {e}");
        match op {
            Op::Create | Op::Mkdir | Op::Symlink => {
                let Some(dir) = pick(rng, &dirs).cloned() else {
                    return Ok(None);
                };
                let pfx = match op {
                    Op::Create => "f",
                    Op::Mkdir => "d",
                    _ => "s",
                };
                let name = self.fresh_name(sh, rng, pfx);
                let path = model::join(&dir, &name);
                let pino = ino_of(sh, &dir);
                let desc = format!("{op:?} {path}");
                let (ino, id) = match op {
                    Op::Create => {
                        let perm = *pick(rng, PERMS).unwrap_or(&0o644);
                        let a = fs
                            .create(pino, name.as_bytes(), perm, 0, 0)
                            .map_err(err(desc.clone()))?;
                        (a.ino, sh.model.create(&path, perm))
                    }
                    Op::Mkdir => {
                        let perm = *pick(rng, DIR_PERMS).unwrap_or(&0o755);
                        let a = fs
                            .mkdir(pino, name.as_bytes(), perm, 0, 0)
                            .map_err(err(desc.clone()))?;
                        (a.ino, sh.model.mkdir(&path, perm))
                    }
                    _ => {
                        let len = if rng.gen_bool(0.5) {
                            rng.gen_range(1..60)
                        } else {
                            rng.gen_range(60..(self.bs - 1).min(600))
                        };
                        let target = sh.model.fresh_bytes(sh.names as u32, len);
                        let a = fs
                            .symlink(pino, name.as_bytes(), &target, 0, 0)
                            .map_err(err(desc.clone()))?;
                        (a.ino, sh.model.symlink(&path, &target))
                    }
                };
                sh.inos.insert(id, ino);
                Ok(Some(desc))
            }
            Op::Append | Op::Overwrite => {
                let Some(p) = pick(rng, &files).cloned() else {
                    return Ok(None);
                };
                let id = sh.model.id(&p);
                let size = sh.model.tree.inodes[&id].meta.size;
                let off = if op == Op::Append || size == 0 {
                    size
                } else if rng.gen_bool(0.5) {
                    rng.gen_range(0..size.div_ceil(bs)) * bs
                } else {
                    rng.gen_range(0..size)
                };
                let mut len = if rng.gen_bool(0.4) {
                    rng.gen_range(1..=self.spec.max_write_blocks) * bs
                } else {
                    rng.gen_range(1..=self.spec.max_write_blocks * bs)
                };
                len = len.min(max_size.saturating_sub(off));
                if len == 0 {
                    return Ok(None);
                }
                let data = sh.model.write(id, off, len as usize);
                let desc = format!("{op:?} {p} @{off}+{len}");
                let n = fs
                    .write(ino_of(sh, &p), off, &data)
                    .map_err(err(desc.clone()))?;
                if n != data.len() {
                    return Err(format!("{desc}: short write {n}"));
                }
                Ok(Some(desc))
            }
            Op::TruncDown | Op::TruncUp => {
                let Some(p) = pick(rng, &files).cloned() else {
                    return Ok(None);
                };
                let id = sh.model.id(&p);
                let size = sh.model.tree.inodes[&id].meta.size;
                let new = if op == Op::TruncDown {
                    if size == 0 {
                        return Ok(None);
                    }
                    if rng.gen_bool(0.3) {
                        0
                    } else {
                        rng.gen_range(0..size)
                    }
                } else {
                    (size + rng.gen_range(1..=4 * bs)).min(max_size)
                };
                let desc = format!("truncate {p} {size} -> {new}");
                fs.setattr(
                    ino_of(sh, &p),
                    &SetAttr {
                        size: Some(new),
                        ..Default::default()
                    },
                )
                .map_err(err(desc.clone()))?;
                sh.model.truncate(id, new);
                Ok(Some(desc))
            }
            Op::Fallocate | Op::FallocKeep | Op::Punch => {
                let Some(p) = pick(rng, &files).cloned() else {
                    return Ok(None);
                };
                let id = sh.model.id(&p);
                let size = sh.model.tree.inodes[&id].meta.size;
                if op == Op::Punch && size == 0 {
                    return Ok(None);
                }
                let off = match op {
                    Op::Punch => rng.gen_range(0..size),
                    Op::FallocKeep => rng.gen_range(0..=size + 4 * bs),
                    _ => rng.gen_range(0..=size),
                };
                let off = if rng.gen_bool(0.4) {
                    off / bs * bs
                } else {
                    off
                };
                let len = rng.gen_range(1..=4 * bs).min(max_size.saturating_sub(off));
                if len == 0 {
                    return Ok(None);
                }
                let flags = FallocFlags {
                    keep_size: op != Op::Fallocate,
                    punch_hole: op == Op::Punch,
                    zero_range: false,
                };
                let desc = format!("{op:?} {p} @{off}+{len}");
                fs.fallocate(ino_of(sh, &p), off, len, flags)
                    .map_err(err(desc.clone()))?;
                match op {
                    Op::Punch => sh.model.punch(id, off, len),
                    _ => sh.model.fallocate(id, off, len, op == Op::FallocKeep),
                }
                Ok(Some(desc))
            }
            Op::Rename => {
                let entries: Vec<String> =
                    of_kind(None).into_iter().filter(|p| p != home).collect();
                let Some(from) = pick(rng, &entries).cloned() else {
                    return Ok(None);
                };
                let from_kind = t.kind(&from);
                let from_id = t.paths[&from];
                // Destination directory: not the source or below it.
                let dests: Vec<&String> = dirs
                    .iter()
                    .filter(|d| !model::is_within(d, &from))
                    .collect();
                let Some(&dir) = pick(rng, &dests) else {
                    return Ok(None);
                };
                let dir = dir.clone();
                let mut to = None;
                if rng.gen_bool(0.5) {
                    // Replace an existing compatible entry.
                    let victims: Vec<String> = t
                        .children(&dir)
                        .into_iter()
                        .filter(|v| {
                            *v != from
                                && t.paths[v] != from_id
                                && match from_kind {
                                    Some(Kind::Dir) => {
                                        t.kind(v) == Some(Kind::Dir)
                                            && t.children(v).is_empty()
                                            && !model::is_within(&from, v)
                                    }
                                    _ => t.kind(v) != Some(Kind::Dir),
                                }
                        })
                        .collect();
                    to = pick(rng, &victims).cloned();
                }
                let to = match to {
                    Some(v) => v,
                    None => {
                        let name = self.fresh_name(sh, rng, "r");
                        model::join(&dir, &name)
                    }
                };
                let desc = format!("rename {from} -> {to}");
                let (fp, tp) = (model::parent_of(&from), model::parent_of(&to));
                fs.rename(
                    ino_of(sh, fp),
                    model::name_of(&from).as_bytes(),
                    ino_of(sh, tp),
                    model::name_of(&to).as_bytes(),
                    RenameFlags::default(),
                )
                .map_err(err(desc.clone()))?;
                sh.model.rename(&from, &to);
                Ok(Some(desc))
            }
            Op::Exchange => {
                let nondir: Vec<String> = of_kind(None)
                    .into_iter()
                    .filter(|p| t.kind(p) != Some(Kind::Dir))
                    .collect();
                if nondir.len() < 2 {
                    return Ok(None);
                }
                let a = pick(rng, &nondir).cloned().unwrap_or_default();
                let b = pick(rng, &nondir).cloned().unwrap_or_default();
                if a == b || t.paths[&a] == t.paths[&b] {
                    return Ok(None);
                }
                let desc = format!("exchange {a} <-> {b}");
                fs.rename(
                    ino_of(sh, model::parent_of(&a)),
                    model::name_of(&a).as_bytes(),
                    ino_of(sh, model::parent_of(&b)),
                    model::name_of(&b).as_bytes(),
                    RenameFlags {
                        exchange: true,
                        noreplace: false,
                    },
                )
                .map_err(err(desc.clone()))?;
                sh.model.exchange(&a, &b);
                Ok(Some(desc))
            }
            Op::Link => {
                let Some(src) = pick(rng, &files).cloned() else {
                    return Ok(None);
                };
                let Some(dir) = pick(rng, &dirs).cloned() else {
                    return Ok(None);
                };
                let name = self.fresh_name(sh, rng, "l");
                let to = model::join(&dir, &name);
                let desc = format!("link {src} -> {to}");
                fs.link(ino_of(sh, &src), ino_of(sh, &dir), name.as_bytes())
                    .map_err(err(desc.clone()))?;
                sh.model.link(&src, &to);
                Ok(Some(desc))
            }
            Op::Unlink => {
                let nondir: Vec<String> = of_kind(None)
                    .into_iter()
                    .filter(|p| t.kind(p) != Some(Kind::Dir))
                    .collect();
                let Some(p) = pick(rng, &nondir).cloned() else {
                    return Ok(None);
                };
                let desc = format!("unlink {p}");
                fs.unlink(
                    ino_of(sh, model::parent_of(&p)),
                    model::name_of(&p).as_bytes(),
                )
                .map_err(err(desc.clone()))?;
                sh.model.unlink(&p);
                Ok(Some(desc))
            }
            Op::Rmdir => {
                let empty: Vec<String> = of_kind(Some(Kind::Dir))
                    .into_iter()
                    .filter(|d| d != home && d != "/" && t.children(d).is_empty())
                    .collect();
                let Some(p) = pick(rng, &empty).cloned() else {
                    return Ok(None);
                };
                let desc = format!("rmdir {p}");
                fs.rmdir(
                    ino_of(sh, model::parent_of(&p)),
                    model::name_of(&p).as_bytes(),
                )
                .map_err(err(desc.clone()))?;
                sh.model.rmdir(&p);
                Ok(Some(desc))
            }
            Op::SetXattr | Op::RemoveXattr | Op::Chmod => {
                let targets: Vec<String> = of_kind(None)
                    .into_iter()
                    .filter(|p| t.kind(p) != Some(Kind::Symlink) && (p != home || home != "/"))
                    .collect();
                let Some(p) = pick(rng, &targets).cloned() else {
                    return Ok(None);
                };
                let id = sh.model.id(&p);
                let ino = ino_of(sh, &p);
                match op {
                    Op::SetXattr => {
                        let name = *pick(rng, XATTR_NAMES).unwrap_or(&"user.a");
                        // Small values stay in the inode; larger ones need the block.
                        let len = if rng.gen_bool(0.5) {
                            rng.gen_range(0..24)
                        } else {
                            rng.gen_range(24..=self.bs / 8)
                        };
                        let value = sh.model.fresh_bytes(id, len);
                        let desc = format!("setxattr {p} {name} ({len} bytes)");
                        fs.setxattr(ino, name.as_bytes(), &value, XattrFlags::default())
                            .map_err(err(desc.clone()))?;
                        sh.model.setxattr(id, name.as_bytes(), &value);
                        Ok(Some(desc))
                    }
                    Op::RemoveXattr => {
                        let names: Vec<Vec<u8>> =
                            t.inodes[&id].meta.xattrs.keys().cloned().collect();
                        let Some(name) = pick(rng, &names).cloned() else {
                            return Ok(None);
                        };
                        let desc = format!("removexattr {p} {}", String::from_utf8_lossy(&name));
                        fs.removexattr(ino, &name).map_err(err(desc.clone()))?;
                        sh.model.removexattr(id, &name);
                        Ok(Some(desc))
                    }
                    _ => {
                        let perms = if t.kind(&p) == Some(Kind::Dir) {
                            DIR_PERMS
                        } else {
                            PERMS
                        };
                        let perm = *pick(rng, perms).unwrap_or(&0o644);
                        let desc = format!("chmod {p} {perm:o}");
                        fs.setattr(
                            ino,
                            &SetAttr {
                                mode: Some(perm),
                                ..Default::default()
                            },
                        )
                        .map_err(err(desc.clone()))?;
                        sh.model.chmod(id, perm);
                        Ok(Some(desc))
                    }
                }
            }
            Op::Fsync | Op::Fsyncdir | Op::Sync => Ok(None),
        }
    }
}

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> Option<&'a T> {
    if v.is_empty() {
        None
    } else {
        v.get(rng.gen_range(0..v.len()))
    }
}
