//! Implementations of the `commitfs` subcommands (the binary only parses arguments).

pub mod demo;
pub mod fsck;
pub mod info;
pub mod mkfs;
pub mod mount;
pub mod size;
pub mod stats;
