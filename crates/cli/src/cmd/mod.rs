//! Implementations of the `commitfs` subcommands (the binary only parses arguments).

pub mod demo;
pub mod fsck;
pub mod info;
pub mod mkfs;
pub mod mount;
/// Human sizes (`64M`, `1.5G`): one home, in the device crate.
pub use commitfs_device::size;
pub mod stats;
