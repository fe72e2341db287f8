//! Conversions at the FUSE boundary: errno mapping, inode numbers, attributes, times.
//!
//! This is the only place in commitfs where an [`FsError`] becomes an errno.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use commitfs_fs::{Attr, FileType, FsError, Ino, Timestamp, ROOT_INO};
use fuser::{Errno, FileAttr, INodeNo};

/// The errno for a library error.
pub fn errno_of(e: &FsError) -> i32 {
    if e.is_corruption() {
        return libc::EUCLEAN;
    }
    match e {
        FsError::NotFound => libc::ENOENT,
        FsError::Exists => libc::EEXIST,
        FsError::NotDir => libc::ENOTDIR,
        FsError::IsDir => libc::EISDIR,
        FsError::NotEmpty => libc::ENOTEMPTY,
        FsError::NoSpace => libc::ENOSPC,
        FsError::NameTooLong => libc::ENAMETOOLONG,
        FsError::Invalid(_) => libc::EINVAL,
        FsError::ReadOnly => libc::EROFS,
        FsError::TooManyLinks => libc::EMLINK,
        FsError::NoData => libc::ENODATA,
        FsError::XattrTooBig => libc::E2BIG,
        FsError::FileTooBig => libc::EFBIG,
        FsError::NoSuchOffset => libc::ENXIO,
        FsError::Permission(_) => libc::EPERM,
        FsError::AccessDenied(_) => libc::EACCES,
        FsError::NotSupported(_) | FsError::UnsupportedFeature(_) => libc::EOPNOTSUPP,
        FsError::Corrupt(_) | FsError::CorruptMsg(_) => libc::EUCLEAN,
        // Only at mount time; the kernel's answer for a missing superblock.
        FsError::Open(_) => libc::EINVAL,
        FsError::NeedsRecovery | FsError::Device(_) | FsError::Journal(_) => libc::EIO,
        FsError::DataWriteFailed
        | FsError::WritebackIncomplete
        | FsError::Shutdown
        | FsError::MetadataMiss(_) => libc::EIO,
    }
}

/// [`errno_of`] as fuser's type, logging the serious ones.
pub fn to_errno(op: &str, e: &FsError) -> Errno {
    let n = errno_of(e);
    match n {
        libc::EIO | libc::EUCLEAN => tracing::error!("{op}: {e}"),
        libc::EOPNOTSUPP => tracing::info!("{op}: {e}"),
        _ => tracing::debug!("{op}: {e}"),
    }
    Errno::from_i32(n)
}

/// FUSE's root is inode 1, ext4's is 2. Swap the two so the mapping is a
/// bijection (ext4 inode 1, the bad-blocks inode, is never reachable by name).
pub fn fuse_ino(ino: Ino) -> INodeNo {
    INodeNo(match ino {
        ROOT_INO => 1,
        1 => ROOT_INO as u64,
        n => n as u64,
    })
}

/// Inverse of [`fuse_ino`]; numbers beyond 32 bits cannot exist in ext4.
pub fn ext4_ino(ino: INodeNo) -> Result<Ino, Errno> {
    match ino.0 {
        1 => Ok(ROOT_INO),
        n if n == ROOT_INO as u64 => Ok(1),
        0 => Err(Errno::EINVAL),
        n => Ino::try_from(n).map_err(|_| Errno::ENOENT),
    }
}

pub fn fuse_kind(k: FileType) -> fuser::FileType {
    match k {
        FileType::Regular => fuser::FileType::RegularFile,
        FileType::Directory => fuser::FileType::Directory,
        FileType::Symlink => fuser::FileType::Symlink,
        FileType::CharDevice => fuser::FileType::CharDevice,
        FileType::BlockDevice => fuser::FileType::BlockDevice,
        FileType::Fifo => fuser::FileType::NamedPipe,
        FileType::Socket => fuser::FileType::Socket,
    }
}

pub fn system_time(t: Timestamp) -> SystemTime {
    let nsec = Duration::from_nanos(t.nsec.min(999_999_999) as u64);
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::from_secs(t.sec as u64) + nsec
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(t.sec.unsigned_abs()))
            .map(|x| x + nsec)
            .unwrap_or(UNIX_EPOCH)
    }
}

/// A time from a request (setattr). fuser 0.18 decodes the kernel's
/// `(sec, nsec)` before 1970 as `EPOCH - (|sec| + nsec)` instead of
/// `EPOCH - |sec| + nsec`; this inverts exactly that decoding, so the pair the
/// kernel sent comes back unchanged (`every_fuse_operation_end_to_end` checks
/// times before 1970 through a real mount).
pub fn request_timestamp(t: SystemTime) -> Timestamp {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timestamp::new(d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => {
            let d = e.duration();
            Timestamp::new(-(d.as_secs().min(i64::MAX as u64) as i64), d.subsec_nanos())
        }
    }
}

pub fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: fuse_ino(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: system_time(a.atime),
        mtime: system_time(a.mtime),
        ctime: system_time(a.ctime),
        crtime: system_time(a.crtime),
        kind: fuse_kind(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
        flags: 0,
    }
}

/// The attributes of a negative LOOKUP answer: node id 0 means "no such
/// name", cached for the entry lifetime (unlike an ENOENT error).
pub fn negative_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: std::time::UNIX_EPOCH,
        mtime: std::time::UNIX_EPOCH,
        ctime: std::time::UNIX_EPOCH,
        crtime: std::time::UNIX_EPOCH,
        kind: fuser::FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commitfs_format::FormatError;

    #[test]
    fn root_mapping_is_a_bijection() {
        assert_eq!(fuse_ino(ROOT_INO), INodeNo(1));
        assert_eq!(ext4_ino(INodeNo(1)).unwrap(), ROOT_INO);
        for n in [1u32, 2, 3, 11, 12, 4_000_000_000] {
            assert_eq!(ext4_ino(fuse_ino(n)).unwrap(), n);
        }
        assert!(ext4_ino(INodeNo(1 << 40)).is_err());
        assert!(ext4_ino(INodeNo(0)).is_err());
    }

    #[test]
    fn errors_map_to_the_documented_errnos() {
        let cases: Vec<(FsError, i32)> = vec![
            (FsError::NotFound, libc::ENOENT),
            (FsError::Exists, libc::EEXIST),
            (FsError::NotDir, libc::ENOTDIR),
            (FsError::IsDir, libc::EISDIR),
            (FsError::NotEmpty, libc::ENOTEMPTY),
            (FsError::NoSpace, libc::ENOSPC),
            (FsError::NameTooLong, libc::ENAMETOOLONG),
            (FsError::Invalid("x"), libc::EINVAL),
            (FsError::ReadOnly, libc::EROFS),
            (FsError::TooManyLinks, libc::EMLINK),
            (FsError::NoData, libc::ENODATA),
            (FsError::XattrTooBig, libc::E2BIG),
            (FsError::FileTooBig, libc::EFBIG),
            (FsError::Permission("x"), libc::EPERM),
            (FsError::AccessDenied("x"), libc::EACCES),
            (FsError::NotSupported("x".into()), libc::EOPNOTSUPP),
            (FsError::corrupt("x"), libc::EUCLEAN),
            (
                FsError::Corrupt(FormatError::corrupt("inode", 5, "bad")),
                libc::EUCLEAN,
            ),
        ];
        for (e, n) in cases {
            assert_eq!(errno_of(&e), n, "{e:?}");
        }
    }

    /// fuser 0.18's decoding of a request time (`system_time_from_time`).
    fn fuser_decode(sec: i64, nsec: u32) -> SystemTime {
        if sec >= 0 {
            UNIX_EPOCH + Duration::new(sec as u64, nsec)
        } else {
            UNIX_EPOCH - Duration::new((-sec) as u64, nsec)
        }
    }

    #[test]
    fn times_round_trip_including_before_1970() {
        for (s, n) in [
            (0i64, 0u32),
            (1_700_000_000, 123_456_789),
            (-1, 500),
            (-100, 0),
        ] {
            let t = Timestamp::new(s, n);
            assert_eq!(request_timestamp(fuser_decode(s, n)), t);
            // Replies: the instant `sec + nsec/1e9`.
            let back = system_time(t);
            let expect = if s >= 0 {
                UNIX_EPOCH + Duration::new(s as u64, n)
            } else {
                UNIX_EPOCH - Duration::from_secs(s.unsigned_abs()) + Duration::from_nanos(n as u64)
            };
            assert_eq!(back, expect);
        }
    }
}

/// The credentials of a request's caller for the setuid/setgid rule: FUSE
/// passes uid, gid and pid only, so the supplementary groups and `CAP_FSETID`
/// come from `/proc/PID/status`. Without it (the caller is gone, or in another
/// pid namespace) only root counts as privileged.
pub fn caller_of(uid: u32, gid: u32, pid: u32) -> commitfs_fs::Caller {
    let mut c = commitfs_fs::Caller {
        uid,
        gid,
        groups: Vec::new(),
        cap_fsetid: uid == 0,
    };
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return c;
    };
    parse_status(&text, &mut c);
    c
}

/// Fill groups and `CAP_FSETID` (capability 4) from a `/proc/PID/status` text.
fn parse_status(text: &str, c: &mut commitfs_fs::Caller) {
    const CAP_FSETID: u32 = 4;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("Groups:") {
            c.groups = v
                .split_whitespace()
                .filter_map(|g| g.parse().ok())
                .collect();
        } else if let Some(v) = line.strip_prefix("CapEff:") {
            if let Ok(bits) = u64::from_str_radix(v.trim(), 16) {
                c.cap_fsetid = bits & (1 << CAP_FSETID) != 0;
            }
        }
    }
}

#[cfg(test)]
mod caller_tests {
    use super::*;

    #[test]
    fn status_gives_groups_and_fsetid() {
        let mut c = commitfs_fs::Caller {
            uid: 1000,
            gid: 1000,
            ..Default::default()
        };
        parse_status(
            "Name:\tx\nGroups:\t4 24 27 \nCapEff:\t0000000000000000\n",
            &mut c,
        );
        assert_eq!(c.groups, vec![4, 24, 27]);
        assert!(!c.cap_fsetid);
        parse_status("CapEff:\t000001ffffffffff\n", &mut c);
        assert!(c.cap_fsetid);
        parse_status("CapEff:\t0000000000000010\n", &mut c);
        assert!(c.cap_fsetid);
        parse_status("CapEff:\t00000000000000ef\n", &mut c);
        assert!(!c.cap_fsetid);
    }
}
