//! Implementations of the `commitfs` subcommands (the binary only parses arguments).

pub mod demo;
pub mod fsck;
pub mod helper;
pub mod info;
pub mod logging;
pub mod mkfs;
pub mod mount;
pub mod size;
pub mod stats;
pub mod umount;
