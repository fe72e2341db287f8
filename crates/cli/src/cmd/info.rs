//! `commitfs info IMAGE [--json]`: superblock and journal facts, read straight from
//! the image (no mount, so it also works on images that need recovery).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{bail, Context, Result};
use commitfs_device::{Access, FileDevice};
use commitfs_format::csum::CsumCtx;
use commitfs_format::extent::NodeRef;
use commitfs_format::group_desc::GroupDesc;
use commitfs_format::inode::Inode;
use commitfs_format::jbd2::JournalSuperblock;
use commitfs_format::superblock::{self as sbf, FeatureKind, Superblock};
use serde::Serialize;

/// Everything `info` reports.
#[derive(Debug, Clone, Serialize)]
pub struct ImageInfo {
    pub image: String,
    /// Feature names, compat then incompat then ro_compat (as `dumpe2fs` lists them).
    pub features: Vec<String>,
    pub block_size: u32,
    pub blocks: u64,
    pub free_blocks: u64,
    pub reserved_blocks: u64,
    pub inodes: u32,
    pub free_inodes: u32,
    pub inode_size: u16,
    pub groups: u32,
    pub blocks_per_group: u32,
    pub inodes_per_group: u32,
    pub uuid: String,
    pub label: String,
    /// "clean", "not clean", "clean with errors" or "not clean with errors".
    pub state: String,
    pub mount_count: u16,
    pub journal: Option<JournalInfo>,
    /// INCOMPAT_RECOVER set or the journal log non-empty.
    pub needs_recovery: bool,
}

/// The internal journal and its JBD2 superblock (ext4-format.md §8.2).
#[derive(Debug, Clone, Serialize)]
pub struct JournalInfo {
    pub inode: u32,
    /// Journal inode size in file-system blocks.
    pub size_blocks: u64,
    /// Physical block holding the JBD2 superblock (journal block 0).
    pub first_block: u64,
    pub magic: String,
    pub blocktype: u32,
    pub s_blocksize: u32,
    pub s_maxlen: u32,
    pub s_first: u32,
    pub s_sequence: u32,
    pub s_start: u32,
    pub s_errno: i32,
    pub features_compat: u32,
    pub features_incompat: u32,
    pub features_ro_compat: u32,
    pub feature_names: Vec<String>,
    pub s_num_fc_blks: u32,
    /// Fast-commit blocks in effect (0 without fast commits).
    pub fast_commit_blocks: u32,
    pub checksum_type: u8,
    /// Committed transactions in the live log (what a recovery would replay), with
    /// their tid range, from a scan of the log (no replay).
    pub live_transactions: Option<u32>,
    pub live_tids: Option<(u32, u32)>,
    /// Why a scan of the live log stopped early (damaged transaction), if it did.
    pub log_damage: Option<String>,
}

fn format_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

fn read_at(f: &File, off: u64, len: usize, what: &str) -> Result<Vec<u8>> {
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, off)
        .with_context(|| format!("reading {what} at byte {off}"))?;
    Ok(b)
}

/// Inspect an image without mounting it.
pub fn inspect(path: &Path) -> Result<ImageInfo> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let raw = read_at(
        &f,
        sbf::SUPERBLOCK_OFFSET,
        sbf::SUPERBLOCK_SIZE,
        "superblock",
    )
    .or_else(|e| {
        // Too short for a superblock: say so the way `mount` does.
        match f.metadata() {
            Ok(m) if m.is_file() && m.len() < 2048 => bail!(
                "{} is not a valid ext4 image: {}",
                path.display(),
                commitfs_fs::probe::OpenError::Empty { size: m.len() }
            ),
            _ => Err(e),
        }
    })?;
    let sb = match Superblock::parse(&raw) {
        Ok(sb) => sb,
        Err(e) => {
            // Say what is there instead (empty, unformatted, a damaged superblock
            // with an intact backup), as `mount` does.
            let why = commitfs_device::FileDevice::open_with(path, Access::Shared)
                .map_err(commitfs_fs::FsError::from)
                .and_then(|d| commitfs_fs::probe::check_superblock(&d))
                .map_err(|e| e.with_image(path));
            match why {
                Err(why) => bail!("{} is not a valid ext4 image: {why}", path.display()),
                Ok(_) => bail!("{} is not a valid ext4 image: {e}", path.display()),
            }
        }
    };
    let mut features = sbf::feature_names(FeatureKind::Compat, sb.feature_compat());
    features.extend(sbf::feature_names(
        FeatureKind::Incompat,
        sb.feature_incompat(),
    ));
    features.extend(sbf::feature_names(
        FeatureKind::RoCompat,
        sb.feature_ro_compat(),
    ));
    let st = sb.state();
    let mut state = if st & sbf::STATE_VALID_FS != 0 {
        "clean".to_string()
    } else {
        "not clean".to_string()
    };
    if st & sbf::STATE_ERROR_FS != 0 {
        state.push_str(" with errors");
    }
    let journal = if sb.has_compat(sbf::COMPAT_HAS_JOURNAL) && sb.journal_inum() != 0 {
        Some(journal_info(&f, &sb).context("reading the journal")?)
    } else {
        None
    };
    let mut journal = journal;
    if let Some(j) = journal.as_mut().filter(|j| j.s_start != 0) {
        // Count the transactions a recovery would replay (read-only scan).
        let dev: commitfs_device::DeviceRef =
            std::sync::Arc::new(FileDevice::open_with(path, Access::Shared)?);
        match commitfs_fs::Fs::inspect_journal(dev) {
            Ok(Some((_, report, _))) => {
                j.live_transactions = Some(report.transactions);
                j.live_tids = Some((report.start_tid, report.end_tid));
                j.log_damage = report.stopped_at.or_else(|| {
                    (report.torn_commits > 0).then(|| {
                        format!(
                            "{} commit block(s) torn after the header, accepted as the kernel does",
                            report.torn_commits
                        )
                    })
                });
            }
            Ok(None) => {}
            Err(e) => j.log_damage = Some(format!("scan failed: {e}")),
        }
    }
    let needs_recovery =
        sb.has_incompat(sbf::INCOMPAT_RECOVER) || journal.as_ref().is_some_and(|j| j.s_start != 0);
    Ok(ImageInfo {
        image: path.display().to_string(),
        features,
        block_size: sb.block_size() as u32,
        blocks: sb.blocks_count(),
        free_blocks: sb.free_blocks_count(),
        reserved_blocks: sb.r_blocks_count(),
        inodes: sb.inodes_count(),
        free_inodes: sb.free_inodes_count(),
        inode_size: sb.inode_size(),
        groups: sb.group_count(),
        blocks_per_group: sb.blocks_per_group(),
        inodes_per_group: sb.inodes_per_group(),
        uuid: format_uuid(&sb.uuid()),
        label: sb.volume_name(),
        state,
        mount_count: sb.mnt_count(),
        journal,
        needs_recovery,
    })
}

/// The journal inode: from the inode table, or (if that copy is unreadable) from the
/// `s_jnl_blocks` backup in the superblock (ext4-format.md §2.2, §8.1).
fn journal_inode(f: &File, sb: &Superblock, csum: &CsumCtx) -> Result<([u8; 60], u64, u32)> {
    let ino = sb.journal_inum();
    let table = (|| -> Result<([u8; 60], u64, u32)> {
        if ino == 0 || ino > sb.inodes_count() {
            bail!("journal inode number {ino} out of range");
        }
        let bs = sb.block_size() as u64;
        let g = (ino - 1) / sb.inodes_per_group();
        let ds = sb.desc_size() as u64;
        let gdt_off = (sb.first_data_block() as u64 + 1) * bs + g as u64 * ds;
        let gd_raw = read_at(f, gdt_off, ds as usize, "group descriptor")?;
        let gd = GroupDesc::parse(&gd_raw, g, gdt_off / bs)?;
        let isz = sb.inode_size() as u64;
        let idx = ((ino - 1) % sb.inodes_per_group()) as u64;
        let off = gd.inode_table * bs + idx * isz;
        if off + isz > sb.blocks_count() * bs {
            bail!("inode table of group {g} lies beyond the end of the file system");
        }
        let raw = read_at(f, off, isz as usize, "journal inode")?;
        let inode = Inode::parse(&raw, ino, csum, off / bs)?;
        Ok((inode.block, inode.size, inode.generation))
    })();
    match table {
        Ok(v) => Ok(v),
        Err(e) => {
            let raw = sb.as_bytes();
            if raw[0xFD] != 1 {
                return Err(e.context("and the superblock has no s_jnl_blocks backup"));
            }
            let mut block = [0u8; 60];
            block.copy_from_slice(&raw[0x10C..0x10C + 60]);
            let lo = u32::from_le_bytes([raw[0x14C], raw[0x14D], raw[0x14E], raw[0x14F]]);
            let hi = u32::from_le_bytes([raw[0x148], raw[0x149], raw[0x14A], raw[0x14B]]);
            Ok((block, (hi as u64) << 32 | lo as u64, 0))
        }
    }
}

/// Physical block of logical block 0 of an extent-mapped inode.
fn map_block0(
    f: &File,
    sb: &Superblock,
    csum: &CsumCtx,
    ino: u32,
    generation: u32,
    i_block: &[u8; 60],
) -> Result<u64> {
    let bs = sb.block_size();
    let mut node_buf: Vec<u8>;
    let mut node = NodeRef::parse_root(i_block, ino)?;
    for _ in 0..=commitfs_format::extent::MAX_DEPTH {
        if node.is_leaf() {
            let i = node
                .search(0)
                .with_context(|| format!("journal inode {ino} does not map block 0"))?;
            let e = node.extent(i).context("extent index out of range")?;
            let p = e
                .map(0)
                .with_context(|| format!("journal inode {ino} does not map block 0"))?;
            return Ok(p);
        }
        let i = node
            .search(0)
            .with_context(|| format!("journal inode {ino}: no index entry for block 0"))?;
        let idx = node.index(i).context("index entry out of range")?;
        if idx.child >= sb.blocks_count() {
            bail!(
                "journal extent tree points at block {} beyond the end",
                idx.child
            );
        }
        let depth = node.depth();
        node_buf = read_at(f, idx.child * bs as u64, bs, "journal extent block")?;
        // Extent blocks of the journal were written by mkfs/the kernel with the
        // inode's generation; a backup copy has none, so skip the checksum then.
        let c = if generation == 0 {
            CsumCtx {
                enabled: false,
                ..*csum
            }
        } else {
            *csum
        };
        node = NodeRef::parse_block(&node_buf, idx.child, Some(depth - 1), &c, ino, generation)?;
    }
    bail!("journal extent tree too deep")
}

fn journal_info(f: &File, sb: &Superblock) -> Result<JournalInfo> {
    let csum = CsumCtx {
        enabled: sb.metadata_csum(),
        fs_seed: sb.csum_seed(),
    };
    let ino = sb.journal_inum();
    let (i_block, size, generation) = journal_inode(f, sb, &csum)?;
    let first_block = map_block0(f, sb, &csum, ino, generation, &i_block)?;
    if first_block >= sb.blocks_count() {
        bail!("journal block 0 maps to {first_block}, beyond the end");
    }
    let bs = sb.block_size() as u64;
    let raw = read_at(f, first_block * bs, 1024, "journal superblock")?;
    let j = JournalSuperblock::parse(&raw, first_block)?;
    let mut names = j.compat_names();
    names.extend(j.incompat_names());
    names.extend(j.ro_compat_names());
    Ok(JournalInfo {
        inode: ino,
        size_blocks: size / bs,
        first_block,
        magic: format!("{:#010x}", commitfs_format::jbd2::JBD2_MAGIC),
        blocktype: j.blocktype,
        s_blocksize: j.blocksize,
        s_maxlen: j.maxlen,
        s_first: j.first,
        s_sequence: j.sequence,
        s_start: j.start,
        s_errno: j.errno,
        features_compat: j.feature_compat,
        features_incompat: j.feature_incompat,
        features_ro_compat: j.feature_ro_compat,
        feature_names: names,
        s_num_fc_blks: j.num_fc_blks,
        fast_commit_blocks: j.fc_blocks(sb.has_compat(sbf::COMPAT_FAST_COMMIT)),
        checksum_type: j.checksum_type,
        live_transactions: None,
        live_tids: None,
        log_damage: None,
    })
}

/// Human-readable rendering.
pub fn render(i: &ImageInfo) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let none = |v: &str| {
        if v.is_empty() {
            "<none>".to_string()
        } else {
            v.to_string()
        }
    };
    let bs = i.block_size as u64;
    let _ = writeln!(s, "Image:            {}", i.image);
    let _ = writeln!(s, "Features:         {}", i.features.join(" "));
    let _ = writeln!(s, "Block size:       {}", i.block_size);
    let _ = writeln!(
        s,
        "Blocks:           {} ({}), free {} ({}), reserved {}",
        i.blocks,
        super::size::human(i.blocks * bs),
        i.free_blocks,
        super::size::human(i.free_blocks * bs),
        i.reserved_blocks
    );
    let _ = writeln!(
        s,
        "Inodes:           {} ({} bytes each), free {}",
        i.inodes, i.inode_size, i.free_inodes
    );
    let _ = writeln!(
        s,
        "Block groups:     {} ({} blocks, {} inodes per group)",
        i.groups, i.blocks_per_group, i.inodes_per_group
    );
    let _ = writeln!(s, "UUID:             {}", i.uuid);
    let _ = writeln!(s, "Label:            {}", none(&i.label));
    let _ = writeln!(s, "State:            {}", i.state);
    let _ = writeln!(s, "Mount count:      {}", i.mount_count);
    match &i.journal {
        None => {
            let _ = writeln!(s, "Journal:          none");
        }
        Some(j) => {
            let _ = writeln!(
                s,
                "Journal:          inode {}, {} blocks ({}), superblock at block {}",
                j.inode,
                j.size_blocks,
                super::size::human(j.size_blocks * bs),
                j.first_block
            );
            let _ = writeln!(
                s,
                "  JBD2:           magic {}, blocktype {}, s_blocksize {}, s_maxlen {}, s_first {}",
                j.magic, j.blocktype, j.s_blocksize, j.s_maxlen, j.s_first
            );
            let _ = writeln!(
                s,
                "  log:            s_sequence {}, s_start {}{}",
                j.s_sequence,
                j.s_start,
                if j.s_start == 0 {
                    " (empty)".to_string()
                } else {
                    match (j.live_transactions, j.live_tids) {
                        (Some(n), Some((a, b))) => format!(
                            " ({n} committed transactions to replay: tids {a}..{})",
                            b.wrapping_sub(1)
                        ),
                        _ => " (live transactions)".to_string(),
                    }
                }
            );
            if let Some(d) = &j.log_damage {
                let _ = writeln!(s, "  log damage:     {d}");
            }
            let names = if j.feature_names.is_empty() {
                "(none)".to_string()
            } else {
                j.feature_names.join(" ")
            };
            let _ = writeln!(
                s,
                "  features:       {names} (compat {:#x}, incompat {:#x}, ro_compat {:#x})",
                j.features_compat, j.features_incompat, j.features_ro_compat
            );
            let _ = writeln!(
                s,
                "  fast commit:    s_num_fc_blks {}, {} blocks in use",
                j.s_num_fc_blks, j.fast_commit_blocks
            );
            if j.s_errno != 0 {
                let _ = writeln!(s, "  s_errno:        {}", j.s_errno);
            }
        }
    }
    let _ = writeln!(
        s,
        "Needs recovery:   {}",
        if i.needs_recovery { "yes" } else { "no" }
    );
    s
}

/// `commitfs info`. On an image in use (mounted, locked by a commitfs mount) it
/// still reports, after a warning on stderr: what it reads may be out of date.
pub fn run(path: &Path, json: bool) -> Result<()> {
    if let Ok(users) = FileDevice::users(path) {
        if !users.is_empty() {
            eprintln!(
                "warning: {} is in use ({}): what follows is read beside it and may be \
                 out of date",
                path.display(),
                commitfs_device::inuse::describe(&users)
            );
        }
    }
    let info = inspect(path)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print!("{}", render(&info));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_format() {
        let u = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(format_uuid(&u), "12345678-9abc-def0-0123-456789abcdef");
    }
}
