//! Checking one crash state: recover it with commitfs and compare with the model.
//!
//! (a) after recovery and a clean unmount, `e2fsck -fn` has nothing to say;
//! (b) the tree (paths, kinds, permissions, link counts, sizes, symlink targets,
//!     xattrs, hard-link structure) equals model snapshot `j` for some `j` in the
//!     crash window `[lo, hi]`;
//! (c) every byte of every file equals that byte in snapshot `j` or in a later
//!     snapshot up to `hi` (ordered mode writes overwrites in place, so newer data
//!     under older metadata is legal) — never data no version in the window had at
//!     that offset, and never non-zero bytes where every version reads zeros;
//! (d) the recovered file system keeps working: create, write, fsync, unmount,
//!     and `e2fsck -fn` is clean again.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use commitfs_device::{FileDevice, MemDevice};
use commitfs_fs::testutil::{fsck, problem_lines};
use commitfs_fs::{Fs, MountOptions, ROOT_INO};

use crate::model::{self, Block, FileId, Kind};
use crate::observe::{self, Observed};
use crate::workload::Recording;

/// What a passing check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pass {
    /// The snapshot the recovered tree equals.
    pub j: usize,
}

/// A temporary image file for e2fsck, deleted on drop. Lives in /dev/shm when there
/// is one (e2fsck of a 16 MiB image then costs milliseconds).
pub struct ScratchFile {
    pub path: PathBuf,
}

impl ScratchFile {
    pub fn new(tag: &str) -> ScratchFile {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        ScratchFile {
            path: dir.join(format!(
                "commitfs-crashtest-{tag}-{}-{}-{nonce}.img",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            )),
        }
    }
}

impl ScratchFile {
    /// Overwrite the file with `img` in place: rewriting existing tmpfs pages is much
    /// cheaper than truncating and allocating them again.
    pub fn write(&self, img: &[u8]) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)
            .map_err(|e| format!("open {}: {e}", self.path.display()))?;
        f.write_all_at(img, 0)
            .and_then(|_| f.set_len(img.len() as u64))
            .map_err(|e| format!("write {}: {e}", self.path.display()))
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub(crate) fn mount_opts() -> MountOptions {
    MountOptions {
        read_only: false,
        commit_interval: 0,
        // Reading what recovery made must not change it (no atime updates).
        atime: commitfs_fs::AtimeMode::Never,
        ..Default::default()
    }
}

/// Run `e2fsck -fn` on `img` (written to `scratch`) and judge its output.
pub fn fsck_image(img: &[u8], scratch: &ScratchFile, when: &str) -> Result<(), String> {
    scratch.write(img)?;
    fsck_file(scratch, when)
}

/// Check the image of crash point `k` against the recording: the tree must be a
/// snapshot in the window `[lo, hi]` ([`Recording::window`]); file data may come
/// from snapshots up to `hi`, and files fdatasync'd before `k` must hold their
/// data as of the fdatasync ([`Recording::data_syncs`]).
pub fn check_image(
    rec: &Recording,
    img: Vec<u8>,
    k: usize,
    scratch: &ScratchFile,
) -> Result<Pass, String> {
    check_image_reusing(rec, img, k, scratch).0
}

/// [`check_image`], also handing back the image buffer (when it could be
/// recovered) so the caller can reuse the allocation for the next state.
pub fn check_image_reusing(
    rec: &Recording,
    img: Vec<u8>,
    k: usize,
    scratch: &ScratchFile,
) -> (Result<Pass, String>, Option<Vec<u8>>) {
    let (lo, hi) = rec.window(k);
    check_image_in(rec, img, (lo, hi, hi), &rec.data_syncs(k), scratch)
}

/// [`check_image_reusing`] with an explicit window `(lo, hi, content_hi)` and
/// fdatasync list (the checker's self-tests).
pub fn check_image_in(
    rec: &Recording,
    img: Vec<u8>,
    (lo, hi, content_hi): (usize, usize, usize),
    data: &[(FileId, usize)],
    scratch: &ScratchFile,
) -> (Result<Pass, String>, Option<Vec<u8>>) {
    let dev = Arc::new(MemDevice::from_vec(img));
    let r = (|| {
        let fs = Fs::open(dev.clone(), mount_opts()).map_err(|e| format!("mount/recovery: {e}"))?;
        let obs = observe::observe(&fs, rec.max_file_size).map_err(|e| format!("(b) {e}"))?;
        let j = match_tree(rec, &obs, lo, hi, content_hi, data)?;
        fs.unmount()
            .map_err(|e| format!("unmount after recovery: {e}"))?;
        Ok(j)
    })();
    // Every Fs is dropped by now (also on error), so the device is ours again.
    let Ok(dev) = Arc::try_unwrap(dev) else {
        return (Err("device still referenced after unmount".into()), None);
    };
    let recovered = dev.into_vec();
    let j = match r {
        Ok(j) => j,
        Err(e) => return (Err(e), Some(recovered)),
    };
    if let Err(e) = fsck_image(&recovered, scratch, "after recovery") {
        return (Err(format!("(a) {e}")), Some(recovered));
    }
    if let Err(e) = still_works(rec, scratch) {
        return (Err(format!("(d) {e}")), Some(recovered));
    }
    (Ok(Pass { j }), Some(recovered))
}

/// (b) and (c): find a snapshot in `[lo, hi]` whose metadata equals the recovered
/// tree and whose content window explains every byte; `data`: the acknowledged
/// fdatasyncs, `(file, snapshot)` (see [`check_content`]).
pub fn match_tree(
    rec: &Recording,
    obs: &Observed,
    lo: usize,
    hi: usize,
    content_hi: usize,
    data: &[(FileId, usize)],
) -> Result<usize, String> {
    let got = obs.canonical();
    let h = model::canonical_hash(&got);
    let got_masked = rec.per_file.then(|| sizes_masked(&got));
    let mut content_err = None;
    for j in lo..=hi {
        let same = match &got_masked {
            // data_order=file: a file's size is its own affair (below).
            Some(g) => sizes_masked(&rec.snaps[j].canonical()) == *g,
            None => rec.snap_hashes[j] == h && rec.snaps[j].canonical() == got,
        };
        if !same {
            continue;
        }
        match check_content(rec, obs, j, content_hi.max(j), data) {
            Ok(()) => return Ok(j),
            Err(e) => {
                content_err.get_or_insert(format!("(c) tree = snapshot {j} but {e}"));
            }
        }
    }
    if let Some(e) = content_err {
        return Err(e);
    }
    // No snapshot matches: explain against the nearest bounds.
    let near = |j: usize| observe::diff(&rec.snaps[j].canonical(), &got);
    let outside = (0..rec.snaps.len())
        .filter(|&j| rec.snap_hashes[j] == h && rec.snaps[j].canonical() == got)
        .collect::<Vec<_>>();
    Err(format!(
        "(b) recovered tree is no snapshot in [{lo}, {hi}]{}; vs snapshot {lo}: {}; vs snapshot {hi}: {}",
        if outside.is_empty() {
            String::new()
        } else {
            format!(" (it equals snapshot(s) {:?})", &outside[..outside.len().min(5)])
        },
        near(lo),
        near(hi)
    ))
}

/// A canonical tree with the sizes of regular files left out (`data_order=file`:
/// the namespace is a prefix of the operations, each file's size and data are
/// checked on their own, [`check_content`]).
fn sizes_masked<'a>(c: &model::Canonical<'a>) -> Vec<(&'a str, model::Meta, usize)> {
    c.iter()
        .map(|&(p, m, g)| {
            let mut m = m.clone();
            if m.kind == Kind::File {
                m.size = 0;
            }
            (p, m, g)
        })
        .collect()
}

/// Whether the recovered namespace and metadata equal `tree`, ignoring what lives
/// in data blocks (file content, and targets of symlinks of 60 bytes or more, which
/// have a data block, ext4-format.md §4.8). For states where committed transactions
/// were lost on purpose (a damaged log): blocks freed and reused by the lost
/// transactions legitimately hold other data then.
pub fn meta_matches_ignoring_data_blocks(tree: &model::Tree, obs: &Observed) -> bool {
    let strip = |m: &model::Meta| {
        let mut m = m.clone();
        if m.kind == Kind::Symlink && m.target.len() >= 60 {
            m.target.clear();
        }
        m
    };
    let a: Vec<(&str, model::Meta, usize)> = tree
        .canonical()
        .into_iter()
        .map(|(p, m, g)| (p, strip(m), g))
        .collect();
    let b: Vec<(&str, model::Meta, usize)> = obs
        .canonical()
        .into_iter()
        .map(|(p, m, g)| (p, strip(m), g))
        .collect();
    a == b
}

/// (c) for snapshot `j`: every byte of every file equals that byte in one of the
/// file's versions in snapshots `j..=hi`. A file fdatasync'd at snapshot `s > j`
/// (in `data`) must also hold its data as of `s`: its size that of a version in
/// `s..=hi` and every byte from those versions (the tree may still be older: an
/// fdatasync does not make other changes durable). A file absent from some
/// snapshot in `s..=hi` (removed later) is not held to it.
///
/// Under `data_order=file` ([`Recording::per_file`]) a file's size and data
/// move only with its own write-back, so they may be older than the tree: the
/// file must equal some version `i` of itself, from its last fsync or
/// fdatasync (its creation if none) up to `hi` — size that of `i`, every byte
/// from versions `i..=hi` (ordered mode overwrites in place). Never another
/// file's data, never stale data.
fn check_content(
    rec: &Recording,
    obs: &Observed,
    j: usize,
    hi: usize,
    data: &[(FileId, usize)],
) -> Result<(), String> {
    let snap = &rec.snaps[j];
    for (path, id) in &snap.paths {
        let ino = &snap.inodes[id];
        if ino.meta.kind != Kind::File {
            continue;
        }
        let got = obs
            .content(path)
            .ok_or_else(|| format!("{path} has no content"))?;
        // The last sync of this file: its bytes may only come from then on.
        let synced = data
            .iter()
            .filter(|&&(f, s)| f == *id && s <= hi && (rec.per_file || s > j))
            .map(|&(_, s)| s)
            .filter(|&s| rec.snaps[s..=hi].iter().all(|t| t.inodes.contains_key(id)))
            .max();
        if rec.per_file {
            check_file_versions(rec, path, *id, got, synced, hi)?;
            continue;
        }
        let from = synced.unwrap_or(j);
        if from > j {
            let sizes: BTreeSet<u64> = rec.snaps[from..=hi]
                .iter()
                .map(|t| t.inodes[id].meta.size)
                .collect();
            if !sizes.contains(&(got.len() as u64)) {
                return Err(format!(
                    "{path} (file id {id}) was fdatasync'd at snapshot {from} but has size {}, none of its sizes {sizes:?} in snapshots {from}..={hi}",
                    got.len()
                ));
            }
        }
        check_bytes(rec, path, *id, got, from, hi)?;
    }
    Ok(())
}

/// The per-file rule of [`check_content`] (`data_order=file`): some version
/// `i` of the file, from its last sync (or its first snapshot) up to `hi`, has
/// the recovered size, and every byte comes from versions `i..=hi`.
fn check_file_versions(
    rec: &Recording,
    path: &str,
    id: FileId,
    got: &[u8],
    synced: Option<usize>,
    hi: usize,
) -> Result<(), String> {
    let first = match synced {
        Some(s) => s,
        None => (0..=hi)
            .find(|&i| rec.snaps[i].inodes.contains_key(&id))
            .unwrap_or(hi),
    };
    // Candidates: each distinct version of the file in the window, newest
    // first, with the recovered size.
    let mut tried: Vec<&Arc<model::Inode>> = Vec::new();
    let mut last_err = None;
    for i in (first..=hi).rev() {
        let Some(v) = rec.snaps[i].inodes.get(&id) else {
            continue;
        };
        if v.meta.size != got.len() as u64 || tried.iter().any(|t| Arc::ptr_eq(t, v)) {
            continue;
        }
        tried.push(v);
        match check_bytes(rec, path, id, got, i, hi) {
            Ok(()) => return Ok(()),
            Err(e) => {
                last_err.get_or_insert(e);
            }
        }
    }
    Err(last_err.unwrap_or_else(|| {
        let sizes: BTreeSet<u64> = rec.snaps[first..=hi]
            .iter()
            .filter_map(|t| t.inodes.get(&id).map(|i| i.meta.size))
            .collect();
        format!(
            "{path} (file id {id}) has size {}, none of its sizes {sizes:?} in snapshots {first}..={hi}{}",
            got.len(),
            if synced.is_some() { " (since its last fsync)" } else { "" }
        )
    }))
}

/// Every byte of `got` (file `id`) equals that byte in one of the file's
/// versions in snapshots `from..=hi`.
fn check_bytes(
    rec: &Recording,
    path: &str,
    id: FileId,
    got: &[u8],
    from: usize,
    hi: usize,
) -> Result<(), String> {
    let bs = rec.bs;
    let zeros = vec![0u8; bs];
    let ino = &rec.snaps[from].inodes[&id];
    for (b, chunk) in got.chunks(bs).enumerate() {
        let n = chunk.len();
        // The version at `from` first: by far the most common answer.
        let at_j = ino.block(b).map_or(&zeros[..n], |x| &x.data[..n]);
        if chunk == at_j {
            continue;
        }
        // Distinct versions of this block over the window.
        let mut versions: Vec<Option<&Arc<Block>>> = Vec::new();
        for s in &rec.snaps[from..=hi] {
            if let Some(i) = s.inodes.get(&id) {
                let v = i.block(b);
                if !versions.iter().any(|w| match (w, v) {
                    (Some(a), Some(c)) => Arc::ptr_eq(a, c),
                    (None, None) => true,
                    _ => false,
                }) {
                    versions.push(v);
                }
            }
        }
        fn view<'a>(v: &Option<&'a Arc<Block>>, zeros: &'a [u8], n: usize) -> &'a [u8] {
            v.map_or(&zeros[..n], |x| &x.data[..n])
        }
        if versions.iter().any(|v| view(v, &zeros, n) == chunk) {
            continue;
        }
        // Mixed versions inside one block are legal (separate writes); each byte
        // must still come from some version.
        if let Some(i) =
            (0..n).find(|&i| !versions.iter().any(|v| view(v, &zeros, n)[i] == chunk[i]))
        {
            let off = b * bs + i;
            let all_zero = versions.iter().all(|v| view(v, &zeros, n)[i] == 0);
            let origin = find_origin(rec, chunk);
            return Err(format!(
                "{path} (file id {id}) block {b} byte {off}: {:#04x} matches none of {} version(s) in snapshots {from}..={hi}{}{}",
                chunk[i],
                versions.len(),
                if all_zero {
                    " (every allowed version reads zeros here: stale or foreign data exposed)"
                } else {
                    " (stale or foreign data)"
                },
                origin
            ));
        }
    }
    Ok(())
}

/// Where a block's data came from, when it is a block of some file in any snapshot.
fn find_origin(rec: &Recording, chunk: &[u8]) -> String {
    let mut hits = BTreeSet::new();
    for (si, s) in rec.snaps.iter().enumerate() {
        for (id, ino) in &s.inodes {
            for (b, blk) in ino.blocks.iter().enumerate() {
                if let Some(blk) = blk {
                    if blk.data[..chunk.len()] == *chunk {
                        hits.insert((*id, b, si));
                    }
                }
            }
        }
        if hits.len() > 3 {
            break;
        }
    }
    match hits.iter().next() {
        Some((id, b, si)) => format!("; the data is file id {id} block {b} as of snapshot {si}"),
        None => String::new(),
    }
}

/// (d) Mount the recovered image again (the copy e2fsck just checked, through a
/// file device: no further copies of the image), create and write a file, fsync,
/// read it back, unmount, and run e2fsck.
fn still_works(rec: &Recording, scratch: &ScratchFile) -> Result<(), String> {
    {
        let dev = Arc::new(
            FileDevice::open(&scratch.path, false).map_err(|e| format!("open scratch: {e}"))?,
        );
        let fs = Fs::open(dev, mount_opts()).map_err(|e| format!("remount: {e}"))?;
        let name = b"crashtest-after-recovery";
        let a = fs
            .create(ROOT_INO, name, 0o644, 0, 0)
            .map_err(|e| format!("create: {e}"))?;
        let data = model::gen_data(u32::MAX, 7, 0, 3 * rec.bs + 100);
        fs.write(a.ino, 0, &data)
            .map_err(|e| format!("write: {e}"))?;
        fs.fsync(a.ino, false).map_err(|e| format!("fsync: {e}"))?;
        let mut back = vec![0u8; data.len()];
        let n = fs
            .read(a.ino, 0, &mut back)
            .map_err(|e| format!("read: {e}"))?;
        if n != data.len() || back != data {
            return Err("data written after recovery reads back wrong".into());
        }
        fs.unmount().map_err(|e| format!("unmount: {e}"))?;
    }
    fsck_file(scratch, "after post-recovery writes")
}

/// Run `e2fsck -fn` on the scratch file as it is.
pub fn fsck_file(scratch: &ScratchFile, when: &str) -> Result<(), String> {
    let r = fsck(&scratch.path);
    if r.is_clean() {
        return Ok(());
    }
    let mut lines = problem_lines(&r.output);
    lines.truncate(15);
    Err(format!(
        "e2fsck -fn {when} (exit {}): {}",
        r.code,
        lines.join(" | ")
    ))
}
