//! Public value types of the library API.

pub use commitfs_format::inode::Timestamp;

/// Inode number.
pub type Ino = u32;

pub const ROOT_INO: Ino = commitfs_format::inode::ROOT_INO;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    Regular,
    Directory,
    Symlink,
    CharDevice,
    BlockDevice,
    Fifo,
    Socket,
}

impl FileType {
    pub fn from_mode(mode: u16) -> Option<FileType> {
        use commitfs_format::inode::*;
        Some(match mode & S_IFMT {
            S_IFREG => FileType::Regular,
            S_IFDIR => FileType::Directory,
            S_IFLNK => FileType::Symlink,
            S_IFCHR => FileType::CharDevice,
            S_IFBLK => FileType::BlockDevice,
            S_IFIFO => FileType::Fifo,
            S_IFSOCK => FileType::Socket,
            _ => return None,
        })
    }
    /// Directory-entry file type code (ext4-format.md §6.3).
    pub fn from_dirent_type(t: u8) -> Option<FileType> {
        Some(match t {
            1 => FileType::Regular,
            2 => FileType::Directory,
            3 => FileType::CharDevice,
            4 => FileType::BlockDevice,
            5 => FileType::Fifo,
            6 => FileType::Socket,
            7 => FileType::Symlink,
            _ => return None,
        })
    }
    pub fn mode_bits(self) -> u16 {
        use commitfs_format::inode::*;
        match self {
            FileType::Regular => S_IFREG,
            FileType::Directory => S_IFDIR,
            FileType::Symlink => S_IFLNK,
            FileType::CharDevice => S_IFCHR,
            FileType::BlockDevice => S_IFBLK,
            FileType::Fifo => S_IFIFO,
            FileType::Socket => S_IFSOCK,
        }
    }
}

/// Attributes of an inode, as `stat` reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub ino: Ino,
    pub kind: FileType,
    /// Permission bits incl. setuid/setgid/sticky (mode & 0o7777).
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// 512-byte sectors allocated.
    pub blocks: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    pub crtime: Timestamp,
    /// Device number (user-space `dev_t` encoding) for device files.
    pub rdev: u32,
    pub generation: u32,
    pub flags: u32,
    pub blksize: u32,
}

/// A time to set: a value or "now".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetTime {
    Now,
    At(Timestamp),
}

/// Fields to change in `setattr`; `None` leaves a field alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetAttr {
    /// Permission bits (mode & 0o7777).
    pub mode: Option<u16>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SetTime>,
    pub mtime: Option<SetTime>,
    pub ctime: Option<Timestamp>,
    pub crtime: Option<Timestamp>,
}

/// One directory entry from `readdir`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: Ino,
    pub kind: FileType,
    pub name: Vec<u8>,
    /// Offset to pass to `readdir` to continue after this entry.
    pub next_offset: u64,
}

impl DirEntry {
    /// An entry as the directory code reports it (`ft`: the dirent's file
    /// type byte; an unknown one reads as a regular file).
    pub(crate) fn of(ino: Ino, ft: u8, name: &[u8], next_offset: u64) -> DirEntry {
        DirEntry {
            ino,
            kind: FileType::from_dirent_type(ft).unwrap_or(FileType::Regular),
            name: name.to_vec(),
            next_offset,
        }
    }
}

/// `statfs` results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    pub blocks: u64,
    pub blocks_free: u64,
    pub blocks_avail: u64,
    pub files: u64,
    pub files_free: u64,
    pub name_max: u32,
}

/// `rename` flags (renameat2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
}

/// `fallocate` modes supported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FallocFlags {
    pub keep_size: bool,
    pub punch_hole: bool,
    pub zero_range: bool,
}

/// `setxattr` flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct XattrFlags {
    pub create: bool,
    pub replace: bool,
}

/// Mount options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    pub read_only: bool,
    /// Seconds between automatic commits (`-o commit=N`).
    pub commit_interval: u32,
    /// Write fast commits on images with the `fast_commit` feature (on by
    /// default, like the kernel; `-o nofast_commit` turns it off). Replaying fast
    /// commits found at mount is always on.
    pub fast_commit: bool,
    /// `-o fc_data_csum` (commitfs extension, docs/FORMAT.md): fast commits carry
    /// CRC32C checksums of the data ranges they map, so data and log go out under
    /// one flush. While mounted this way the image carries an incompat feature bit
    /// the kernel does not know, so it refuses such logs; a clean unmount clears it.
    pub fc_data_csum: bool,
    /// POSIX ACLs with ext4's semantics (`-o acl`, the default; `-o noacl` refuses
    /// `system.posix_acl_*` with EOPNOTSUPP and ignores stored ACLs).
    pub acl: bool,
    /// `-o errors=`: what a metadata or journal I/O error does. `None`: the
    /// superblock's `s_errors` decides (mkfs sets continue), like the kernel.
    pub errors: Option<ErrorsBehavior>,
    /// When reads and readdirs update atime (`-o relatime`, the default, as ext4).
    pub atime: AtimeMode,
    /// `-o nodiratime`: never update the atime of directories.
    pub nodiratime: bool,
    /// `-o lazytime`: atime updates stay in memory until the inode changes
    /// otherwise, is fsynced or synced, at unmount, or after 12 h (ext4's rule).
    pub lazytime: bool,
    /// The journal's commit pipeline (transactions in flight, versions per
    /// buffer, batching; docs/ARCHITECTURE.md "concurrent journaling").
    pub pipeline: commitfs_journal::PipelineOptions,
    /// The file-data page cache with delayed allocation (`-o nocache` turns it
    /// off: writes go to the device at `write()` time). Only on journaled
    /// read-write mounts.
    pub page_cache: bool,
    /// `-o cache_size=MiB`: memory for every cache of the mount together
    /// (file data, metadata buffers, inodes, directories; [`CacheBudget`]).
    pub cache_mb: u32,
    /// `-o data_order=`: what a commit writes of cached file data
    /// ([`DataOrder`]; docs/ARCHITECTURE.md "Per-file data ordering").
    pub data_order: DataOrder,
}

/// Which cached file data a commit must carry (`-o data_order=`).
///
/// Both keep ordered mode's rule that no commit exposes blocks whose data is
/// not written (a file's on-disk size and mapping move only when its data is
/// written back). They differ in what one fsync costs and what a crash may show
/// of files nobody fsynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataOrder {
    /// Every commit first writes back every cached write that returned before
    /// it (the commit cut), so a recovered tree is a prefix of the operations,
    /// file sizes and contents included. An fsync writes all cached data of
    /// every file.
    #[default]
    Prefix,
    /// ext4's delayed-allocation semantics: an fsync writes back only its own
    /// file; other files' cached data goes out with write-back (memory
    /// pressure, the periodic commit, `sync`, unmount, and renaming a file over
    /// an existing one: ext4's `auto_da_alloc`). After a crash the namespace is
    /// still a prefix of the operations, but a file that was not fsynced may
    /// show an older size and content (never another file's or stale data).
    File,
}

impl DataOrder {
    pub fn name(self) -> &'static str {
        match self {
            DataOrder::Prefix => "prefix",
            DataOrder::File => "file",
        }
    }
}

/// How `cache_size=` is shared among the caches (docs/ARCHITECTURE.md
/// "Memory"): file-data pages half, metadata buffers a quarter, decoded inodes
/// and directory indexes an eighth each. Fixed shares keep every cache bounded
/// on its own, whatever the workload, and their sum under the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheBudget {
    pub pages: usize,
    pub buffers: usize,
    pub inodes: usize,
    pub dirs: usize,
}

impl CacheBudget {
    pub fn of_mib(mib: u32) -> CacheBudget {
        let total = (mib as usize).max(1) << 20;
        CacheBudget {
            pages: total / 2,
            buffers: total / 4,
            inodes: total / 8,
            dirs: total / 8,
        }
    }
}

/// `errors=` (ext4 semantics, see docs/ARCHITECTURE.md "Device errors"). In every
/// mode a failed journal write aborts the journal: nothing more is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorsBehavior {
    /// Record the error in the superblock and go on with what still works.
    Continue,
    /// Also abort the journal and refuse every change from then on (EROFS).
    RemountRo,
    /// Stop serving at once (everything EIO) and write nothing more, like a crash.
    Panic,
}

impl ErrorsBehavior {
    /// From the superblock's `s_errors`; unknown values mean remount-ro, as in
    /// the kernel.
    pub fn from_superblock(v: u16) -> ErrorsBehavior {
        use commitfs_format::superblock as sbf;
        match v {
            sbf::ERRORS_CONTINUE => ErrorsBehavior::Continue,
            sbf::ERRORS_PANIC => ErrorsBehavior::Panic,
            _ => ErrorsBehavior::RemountRo,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ErrorsBehavior::Continue => "continue",
            ErrorsBehavior::RemountRo => "remount-ro",
            ErrorsBehavior::Panic => "panic",
        }
    }
}

/// Access-time update policy (ext4's `strictatime`, `relatime`, `noatime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AtimeMode {
    /// Every access updates atime.
    Strict,
    /// Update only when atime is not newer than mtime or ctime, or is a day old.
    #[default]
    Relative,
    /// Never update atime on access.
    Never,
}

/// Who makes a data-changing call, for the kernel's setuid/setgid rule
/// (`setattr_should_drop_suidgid`): a caller without `CAP_FSETID` clears
/// S_ISUID, and S_ISGID when the file is group-executable or the caller is not
/// in the file's group.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
    /// Holds `CAP_FSETID` (root normally does).
    pub cap_fsetid: bool,
}

/// The caller of a data-changing call, looked up only when the file has a
/// setuid or setgid bit (looking up supplementary groups and capabilities costs
/// a `/proc` read at the FUSE boundary). `None`: a privileged caller.
pub type CallerOf<'a> = Option<&'a (dyn Fn() -> Caller + Sync)>;

impl Caller {
    /// Is the caller a member of group `gid`?
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }

    /// `mode` with the bits a change of file data by this caller clears
    /// (only regular files lose them, as in the kernel).
    pub fn mode_after_change(&self, mode: u16, file_gid: u32) -> u16 {
        use commitfs_format::inode::{S_IFMT, S_IFREG};
        if self.cap_fsetid || mode & S_IFMT != S_IFREG {
            return mode;
        }
        let mut m = mode & !0o4000;
        if mode & 0o2000 != 0 && (mode & 0o010 != 0 || !self.in_group(file_gid)) {
            m &= !0o2000;
        }
        m
    }
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            read_only: false,
            commit_interval: 5,
            fast_commit: true,
            fc_data_csum: false,
            acl: true,
            errors: None,
            atime: AtimeMode::default(),
            nodiratime: false,
            lazytime: false,
            pipeline: Default::default(),
            page_cache: true,
            cache_mb: 256,
            data_order: DataOrder::Prefix,
        }
    }
}
