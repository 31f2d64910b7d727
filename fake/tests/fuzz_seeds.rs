//! Replays every committed input of the fuzz target `fake_sequences` (`fuzz/seeds/`) through
//! its body on the stable toolchain, so that a crash once found stays fixed.

use std::path::Path;

#[test]
fn every_committed_fake_sequence_replays_cleanly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/fake_sequences");
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "no inputs in {}", dir.display());
    for input in inputs {
        let data = std::fs::read(&input).unwrap();
        let replay =
            std::panic::catch_unwind(|| multicluster_runtime_fake::fuzzing::sequences(&data));
        assert!(replay.is_ok(), "{} fails", input.display());
    }
}
