//! Fuzz target: see `commitfs_fuzz::props::jbd2` for the input layout and properties.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    commitfs_fuzz::props::jbd2(data);
});
