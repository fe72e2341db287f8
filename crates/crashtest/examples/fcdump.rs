//! Print what recovery would find in a crash image's fast-commit area: the JBD2
//! recovery's end tid, the scan's end, and every record of the valid commits
//! (`commitfs_crashtest::jlog::fast_commit_scan`; understands commitfs's
//! DATA_CSUM records on `fc_data_csum` images, which debugfs refuses to open).
//!
//! ```sh
//! cargo run --release -p commitfs-crashtest --example fcdump -- IMAGE...
//! ```

use commitfs_crashtest::jlog;
use commitfs_format::fast_commit::Tlv;

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        eprintln!("usage: fcdump IMAGE...");
        std::process::exit(2);
    }
    for p in paths {
        let img = match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("{p}: {e}");
                continue;
            }
        };
        match jlog::fast_commit_scan(&img) {
            Err(e) => println!("{p}: {e}"),
            Ok(None) => println!("{p}: nothing for recovery to scan"),
            Ok(Some((tid, scan))) => {
                println!(
                    "{p}: expected tid {tid}, {} valid fast commit(s), {} block(s) read, \
                     scan ends {:?}{}{}",
                    scan.commits,
                    scan.blocks_scanned,
                    scan.end,
                    if scan.kernel_error() {
                        " (the kernel's recovery would fail)"
                    } else {
                        ""
                    },
                    if jlog::has_fc_data_csum(&img) {
                        " [fc_data_csum image]"
                    } else {
                        ""
                    }
                );
                for t in &scan.tags {
                    match t {
                        Tlv::Pad { .. } => {}
                        Tlv::Inode { ino, raw } => {
                            let size = u32::from_le_bytes(raw[4..8].try_into().unwrap()) as u64
                                | (u32::from_le_bytes(raw[0x6C..0x70].try_into().unwrap()) as u64)
                                    << 32;
                            let links = u16::from_le_bytes(raw[0x1A..0x1C].try_into().unwrap());
                            let mode = u16::from_le_bytes(raw[0..2].try_into().unwrap());
                            println!(
                                "  INODE {ino}: mode {mode:o} links {links} size {size} ({} bytes)",
                                raw.len()
                            );
                        }
                        t => println!("  {t:?}"),
                    }
                }
            }
        }
    }
}
