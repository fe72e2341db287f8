//! Fuzz target: see `commitfs_fuzz::props::dir` for the input layout and properties.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    commitfs_fuzz::props::dir(data);
});
