#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    multicluster_runtime::fuzzing::owner_records(data);
});
