//! The model: what the file tree is after each completed operation.
//!
//! A [`Tree`] maps paths to inode identities ([`FileId`]) and identities to
//! [`Inode`] states (kind, permissions, link count, size, symlink target, xattrs,
//! and for regular files the content block by block). Snapshots share unchanged
//! inodes and blocks through `Arc`, so keeping one tree per operation is cheap.
//!
//! File data written by the workloads is unique per file, offset and version
//! ([`gen_data`]), so a block holding another file's data, or an older version than
//! any the crash window allows, is recognised as foreign or stale.

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Identity of an inode in the model (not its inode number on disk).
pub type FileId = u32;
pub const ROOT_ID: FileId = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    File,
    Dir,
    Symlink,
}

/// Everything compared between the model and a recovered tree, except file data.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Meta {
    pub kind: Kind,
    pub perm: u16,
    pub nlink: u32,
    /// Size of regular files and symlinks; 0 for directories (their size depends on
    /// the on-disk layout, not on the operations).
    pub size: u64,
    pub target: Vec<u8>,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// One block of file content as `read` returns it (zeros beyond EOF).
#[derive(Debug, PartialEq, Eq)]
pub struct Block {
    pub hash: u64,
    pub data: Box<[u8]>,
}

impl Block {
    fn new(data: Box<[u8]>) -> Arc<Block> {
        Arc::new(Block {
            hash: hash_bytes(&data),
            data,
        })
    }
}

pub fn hash_bytes(b: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone)]
pub struct Inode {
    pub meta: Meta,
    /// Content of a regular file; `None` and blocks past the end are zeros.
    pub blocks: Arc<Vec<Option<Arc<Block>>>>,
}

impl Inode {
    fn new(meta: Meta) -> Inode {
        Inode {
            meta,
            blocks: Arc::new(Vec::new()),
        }
    }
    /// Block `b` of the content, `None` for zeros.
    pub fn block(&self, b: usize) -> Option<&Arc<Block>> {
        self.blocks.get(b).and_then(|x| x.as_ref())
    }
}

/// The whole namespace at one moment.
#[derive(Debug, Clone, Default)]
pub struct Tree {
    /// Absolute paths ("/" is the root) to identities.
    pub paths: BTreeMap<String, FileId>,
    pub inodes: BTreeMap<FileId, Arc<Inode>>,
}

/// `(path, metadata, hard-link group)` for every path, sorted by path: two trees
/// are equal when these are. The group is the index of the first path naming the
/// same inode, so link structure is compared without comparing identities.
pub type Canonical<'a> = Vec<(&'a str, &'a Meta, usize)>;

/// Canonical form of any tree given as paths to keys and a key's metadata.
pub fn canonical<'a, K: Ord + Copy>(
    paths: &'a BTreeMap<String, K>,
    meta: impl Fn(K) -> &'a Meta,
) -> Canonical<'a> {
    let mut first: BTreeMap<K, usize> = BTreeMap::new();
    paths
        .iter()
        .enumerate()
        .map(|(i, (p, &k))| {
            let g = *first.entry(k).or_insert(i);
            (p.as_str(), meta(k), g)
        })
        .collect()
}

pub fn canonical_hash(c: &Canonical<'_>) -> u64 {
    let mut h = DefaultHasher::new();
    c.hash(&mut h);
    h.finish()
}

pub fn parent_of(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &path[..i],
    }
}

pub fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

pub fn name_of(path: &str) -> &str {
    &path[path.rfind('/').map_or(0, |i| i + 1)..]
}

/// Whether `path` is `dir` or below it.
pub fn is_within(path: &str, dir: &str) -> bool {
    dir == "/"
        || path == dir
        || (path.starts_with(dir) && path.as_bytes().get(dir.len()) == Some(&b'/'))
}

impl Tree {
    pub fn canonical(&self) -> Canonical<'_> {
        canonical(&self.paths, |id| &self.inodes[&id].meta)
    }

    pub fn inode(&self, path: &str) -> Option<&Arc<Inode>> {
        self.inodes.get(self.paths.get(path)?)
    }

    pub fn kind(&self, path: &str) -> Option<Kind> {
        self.inode(path).map(|i| i.meta.kind)
    }

    /// Direct children of directory `dir`.
    pub fn children(&self, dir: &str) -> Vec<String> {
        let prefix = if dir == "/" {
            "/".to_string()
        } else {
            format!("{dir}/")
        };
        self.paths
            .range(prefix.clone()..)
            .take_while(|(p, _)| p.starts_with(&prefix))
            .filter(|(p, _)| !p[prefix.len()..].contains('/') && p.len() > prefix.len())
            .map(|(p, _)| p.clone())
            .collect()
    }

    fn meta_mut(&mut self, id: FileId) -> &mut Meta {
        &mut Arc::make_mut(self.inodes.get_mut(&id).expect("model inode")).meta
    }
}

/// The model of one workload run: the current tree plus counters for fresh
/// identities and data versions.
pub struct Model {
    pub bs: usize,
    pub tree: Tree,
    next_id: FileId,
    next_version: u32,
}

/// Data byte `o` (absolute file offset) of version `version` of file `id`. Every
/// 8-byte word is a hash of (id, version, word index), so equal blocks of two files
/// or two versions are practically impossible.
pub fn gen_data(id: FileId, version: u32, off: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut o = off;
    while out.len() < len {
        let w = mix((id as u64) << 32 ^ version as u64, o / 8);
        let bytes = w.to_le_bytes();
        let from = (o % 8) as usize;
        let n = (8 - from).min(len - out.len());
        out.extend_from_slice(&bytes[from..from + n]);
        o += n as u64;
    }
    out
}

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(0x2545_F491_4F6C_DD1D);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Model {
    /// A model whose root has metadata `root` (observed on the base image).
    pub fn new(bs: usize, root: Meta) -> Model {
        let mut tree = Tree::default();
        tree.paths.insert("/".into(), ROOT_ID);
        tree.inodes.insert(ROOT_ID, Arc::new(Inode::new(root)));
        Model {
            bs,
            tree,
            next_id: 1,
            next_version: 1,
        }
    }

    fn add(&mut self, path: &str, meta: Meta) -> FileId {
        let id = self.next_id;
        self.next_id += 1;
        self.tree.paths.insert(path.to_string(), id);
        self.tree.inodes.insert(id, Arc::new(Inode::new(meta)));
        id
    }

    fn plain(kind: Kind, perm: u16, nlink: u32) -> Meta {
        Meta {
            kind,
            perm,
            nlink,
            size: 0,
            target: Vec::new(),
            xattrs: BTreeMap::new(),
        }
    }

    pub fn id(&self, path: &str) -> FileId {
        self.tree.paths[path]
    }

    pub fn create(&mut self, path: &str, perm: u16) -> FileId {
        self.add(path, Self::plain(Kind::File, perm, 1))
    }

    pub fn mkdir(&mut self, path: &str, perm: u16) -> FileId {
        let parent = self.id(parent_of(path));
        self.tree.meta_mut(parent).nlink += 1;
        self.add(path, Self::plain(Kind::Dir, perm, 2))
    }

    pub fn symlink(&mut self, path: &str, target: &[u8]) -> FileId {
        let mut m = Self::plain(Kind::Symlink, 0o777, 1);
        m.size = target.len() as u64;
        m.target = target.to_vec();
        self.add(path, m)
    }

    pub fn link(&mut self, existing: &str, new: &str) {
        let id = self.id(existing);
        self.tree.meta_mut(id).nlink += 1;
        self.tree.paths.insert(new.to_string(), id);
    }

    /// Remove a non-directory name.
    pub fn unlink(&mut self, path: &str) {
        let id = self
            .tree
            .paths
            .remove(path)
            .expect("unlink of a missing path");
        let m = self.tree.meta_mut(id);
        m.nlink -= 1;
        if m.nlink == 0 {
            self.tree.inodes.remove(&id);
        }
    }

    /// Remove an empty directory.
    pub fn rmdir(&mut self, path: &str) {
        let id = self
            .tree
            .paths
            .remove(path)
            .expect("rmdir of a missing path");
        self.tree.inodes.remove(&id);
        let parent = self.id(parent_of(path));
        self.tree.meta_mut(parent).nlink -= 1;
    }

    /// POSIX rename: `to` (if it exists) is replaced.
    pub fn rename(&mut self, from: &str, to: &str) {
        if self.tree.paths.contains_key(to) {
            match self.tree.kind(to) {
                Some(Kind::Dir) => self.rmdir(to),
                _ => self.unlink(to),
            }
        }
        let id = self.id(from);
        let is_dir = self.tree.inodes[&id].meta.kind == Kind::Dir;
        if is_dir {
            let moved: Vec<(String, FileId)> = self
                .tree
                .paths
                .iter()
                .filter(|(p, _)| is_within(p, from))
                .map(|(p, &i)| (p.clone(), i))
                .collect();
            for (p, _) in &moved {
                self.tree.paths.remove(p);
            }
            for (p, i) in moved {
                let np = format!("{to}{}", &p[from.len()..]);
                self.tree.paths.insert(np, i);
            }
            let (pf, pt) = (self.id(parent_of(from)), self.id(parent_of(to)));
            if pf != pt {
                self.tree.meta_mut(pf).nlink -= 1;
                self.tree.meta_mut(pt).nlink += 1;
            }
        } else {
            self.tree.paths.remove(from);
            self.tree.paths.insert(to.to_string(), id);
        }
    }

    /// RENAME_EXCHANGE of two non-directories.
    pub fn exchange(&mut self, a: &str, b: &str) {
        let ia = self.id(a);
        let ib = self.id(b);
        self.tree.paths.insert(a.to_string(), ib);
        self.tree.paths.insert(b.to_string(), ia);
    }

    pub fn chmod(&mut self, id: FileId, perm: u16) {
        self.tree.meta_mut(id).perm = perm;
    }

    pub fn setxattr(&mut self, id: FileId, name: &[u8], value: &[u8]) {
        self.tree
            .meta_mut(id)
            .xattrs
            .insert(name.to_vec(), value.to_vec());
    }

    pub fn removexattr(&mut self, id: FileId, name: &[u8]) {
        self.tree.meta_mut(id).xattrs.remove(name);
    }

    /// A fresh, unique xattr value or symlink target body.
    pub fn fresh_bytes(&mut self, id: FileId, len: usize) -> Vec<u8> {
        let v = self.next_version;
        self.next_version += 1;
        // Printable, never NUL (symlink targets are C strings).
        gen_data(id, v, 0, len)
            .into_iter()
            .map(|b| b'!' + b % 90)
            .collect()
    }

    /// Change bytes of file `id` through `f(block_data, block_index)`, growing the
    /// block list as needed and keeping every byte beyond `size` zero.
    fn edit_blocks(&mut self, id: FileId, first: usize, last: usize, f: impl Fn(&mut [u8], usize)) {
        let bs = self.bs;
        let ino = Arc::make_mut(self.tree.inodes.get_mut(&id).expect("model inode"));
        let blocks = Arc::make_mut(&mut ino.blocks);
        if blocks.len() <= last {
            blocks.resize(last + 1, None);
        }
        for (b, slot) in blocks.iter_mut().enumerate().take(last + 1).skip(first) {
            let mut data: Box<[u8]> = match slot {
                Some(x) => x.data.clone(),
                None => vec![0u8; bs].into_boxed_slice(),
            };
            f(&mut data, b);
            *slot = if data.iter().all(|&x| x == 0) {
                None
            } else {
                Some(Block::new(data))
            };
        }
        while blocks.last().is_some_and(|b| b.is_none()) {
            blocks.pop();
        }
    }

    /// A write of `len` fresh bytes at `off`; returns the bytes to write.
    pub fn write(&mut self, id: FileId, off: u64, len: usize) -> Vec<u8> {
        let v = self.next_version;
        self.next_version += 1;
        let data = gen_data(id, v, off, len);
        if len == 0 {
            return data;
        }
        let bs = self.bs as u64;
        let end = off + len as u64;
        let (first, last) = ((off / bs) as usize, ((end - 1) / bs) as usize);
        self.edit_blocks(id, first, last, |blk, b| {
            let bstart = b as u64 * bs;
            let s = off.max(bstart);
            let e = end.min(bstart + bs);
            blk[(s - bstart) as usize..(e - bstart) as usize]
                .copy_from_slice(&data[(s - off) as usize..(e - off) as usize]);
        });
        let m = self.tree.meta_mut(id);
        m.size = m.size.max(end);
        data
    }

    /// Zero `[from, to)` of the content (clamped to what exists).
    fn zero(&mut self, id: FileId, from: u64, to: u64) {
        let bs = self.bs as u64;
        let have = self.tree.inodes[&id].blocks.len() as u64 * bs;
        let to = to.min(have);
        if from >= to {
            return;
        }
        let (first, last) = ((from / bs) as usize, ((to - 1) / bs) as usize);
        self.edit_blocks(id, first, last, |blk, b| {
            let bstart = b as u64 * bs;
            let s = from.max(bstart);
            let e = to.min(bstart + bs);
            blk[(s - bstart) as usize..(e - bstart) as usize].fill(0);
        });
    }

    pub fn truncate(&mut self, id: FileId, size: u64) {
        let old = self.tree.inodes[&id].meta.size;
        if size < old {
            self.zero(id, size, u64::MAX);
        }
        self.tree.meta_mut(id).size = size;
    }

    /// FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE.
    pub fn punch(&mut self, id: FileId, off: u64, len: u64) {
        let size = self.tree.inodes[&id].meta.size;
        self.zero(id, off, (off + len).min(size));
    }

    /// Plain fallocate: the content is unchanged (new blocks read as zeros); without
    /// KEEP_SIZE the size grows to cover the range.
    pub fn fallocate(&mut self, id: FileId, off: u64, len: u64, keep_size: bool) {
        if !keep_size {
            let m = self.tree.meta_mut(id);
            m.size = m.size.max(off + len);
        }
    }

    /// The whole content of file `id` as `read` returns it.
    pub fn content(&self, id: FileId) -> Vec<u8> {
        content_of(&self.tree.inodes[&id], self.bs)
    }
}

/// The whole content of a model inode.
pub fn content_of(ino: &Inode, bs: usize) -> Vec<u8> {
    let size = ino.meta.size as usize;
    let mut out = vec![0u8; size];
    for (b, blk) in ino.blocks.iter().enumerate() {
        let s = b * bs;
        if s >= size {
            break;
        }
        if let Some(blk) = blk {
            let e = (s + bs).min(size);
            out[s..e].copy_from_slice(&blk.data[..e - s]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> Meta {
        Model::plain(Kind::Dir, 0o755, 3)
    }

    #[test]
    fn data_is_unique_per_file_offset_and_version() {
        let a = gen_data(1, 1, 0, 4096);
        assert_ne!(a, gen_data(2, 1, 0, 4096));
        assert_ne!(a, gen_data(1, 2, 0, 4096));
        assert_ne!(&a[..1024], &a[1024..2048]);
        // Offsets are absolute: a write at 100 agrees with one at 0 on the overlap.
        assert_eq!(&a[100..300], &gen_data(1, 1, 100, 200)[..]);
    }

    #[test]
    fn content_tracks_writes_truncates_and_holes() {
        let mut m = Model::new(1024, root());
        let f = m.create("/f", 0o644);
        let d1 = m.write(f, 0, 3000);
        assert_eq!(m.content(f), d1);
        m.truncate(f, 1500);
        assert_eq!(m.content(f), d1[..1500]);
        m.truncate(f, 5000);
        let c = m.content(f);
        assert_eq!(&c[..1500], &d1[..1500]);
        assert!(
            c[1500..].iter().all(|&b| b == 0),
            "no stale data after extend"
        );
        m.punch(f, 100, 10_000);
        assert!(m.content(f)[100..].iter().all(|&b| b == 0));
        assert_eq!(m.tree.inodes[&f].meta.size, 5000);
        // Beyond-EOF bytes of the last block stay zero in the stored block.
        let d2 = m.write(f, 5000, 10);
        assert_eq!(&m.content(f)[5000..], &d2[..]);
        m.truncate(f, 5005);
        let b4 = m.tree.inodes[&f].block(4).unwrap();
        assert!(b4.data[5005 - 4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn namespace_ops_keep_link_counts() {
        let mut m = Model::new(1024, root());
        m.mkdir("/a", 0o755);
        m.mkdir("/b", 0o755);
        assert_eq!(m.tree.inode("/").unwrap().meta.nlink, 5);
        let f = m.create("/a/f", 0o644);
        m.link("/a/f", "/b/g");
        assert_eq!(m.tree.inodes[&f].meta.nlink, 2);
        m.mkdir("/a/sub", 0o700);
        m.rename("/a", "/b/a2");
        assert_eq!(m.id("/b/a2/f"), f);
        assert_eq!(m.tree.inode("/").unwrap().meta.nlink, 4);
        assert_eq!(m.tree.inode("/b").unwrap().meta.nlink, 3);
        // Replacing one name of a linked inode by another file drops one link.
        let h = m.create("/h", 0o600);
        m.rename("/h", "/b/g");
        assert_eq!(m.tree.inodes[&f].meta.nlink, 1);
        assert_eq!(m.id("/b/g"), h);
        m.unlink("/b/a2/f");
        assert!(!m.tree.inodes.contains_key(&f));
        m.rmdir("/b/a2/sub");
        assert_eq!(m.tree.children("/b/a2"), Vec::<String>::new());
        assert_eq!(
            m.tree.children("/b"),
            vec!["/b/a2".to_string(), "/b/g".to_string()]
        );
    }

    #[test]
    fn canonical_form_compares_link_structure() {
        let mut m = Model::new(1024, root());
        m.create("/x", 0o644);
        m.create("/y", 0o644);
        let t1 = m.tree.clone();
        let mut m2 = Model::new(1024, root());
        m2.create("/x", 0o644);
        m2.link("/x", "/y");
        assert_ne!(t1.canonical(), m2.tree.canonical());
        let mut m3 = Model::new(1024, root());
        m3.create("/y", 0o644);
        m3.create("/x", 0o644);
        assert_eq!(t1.canonical(), m3.tree.canonical());
        assert_eq!(
            canonical_hash(&t1.canonical()),
            canonical_hash(&m3.tree.canonical())
        );
    }
}
