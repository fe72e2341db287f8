//! `commitfs`: the embeddable library (re-exported from the layer crates) and the
//! implementation of the `commitfs` command-line tool.
//!
//! ```no_run
//! use commitfs::{Fs, MountOptions, ROOT_INO};
//! let fs = Fs::open_path("disk.img".as_ref(), MountOptions::default())?;
//! let f = fs.create(ROOT_INO, b"hello.txt", 0o644, 0, 0)?;
//! fs.write(f.ino, 0, b"hello")?;
//! fs.unmount()?;
//! # Ok::<(), commitfs::FsError>(())
//! ```

pub use commitfs_fs::*;

/// The layer crates, for callers that need more than the [`Fs`] API.
pub use commitfs_device as device;
pub use commitfs_format as format;
pub use commitfs_fuse as fuse;
pub use commitfs_journal as journal;

/// The `commitfs` subcommands.
pub mod cmd;

/// Privilege drop of the mount daemon (`commitfs mount`).
pub mod sandbox;
