//! Fuzz target: mount a mutated ext4 image in memory and run a fixed mix of
//! operations (`commitfs_fs::fuzzing::run_case`; input: a template byte, then
//! 7-byte mutations). The templates are made once per process with mkfs.ext4.
#![no_main]

use std::sync::OnceLock;

use commitfs_fs::fuzzing::Templates;
use libfuzzer_sys::fuzz_target;

static TEMPLATES: OnceLock<Templates> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let t = TEMPLATES.get_or_init(|| {
        Templates::build(&std::env::temp_dir()).expect("mount_ops: building the templates")
    });
    commitfs_fs::fuzzing::run_case(t, data);
});
