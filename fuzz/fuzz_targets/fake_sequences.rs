#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    multicluster_runtime_fake::fuzzing::sequences(data);
});
