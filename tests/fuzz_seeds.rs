//! Replays every committed fuzz input (`fuzz/seeds/<target>/`, seeds and past crashes)
//! through the fuzz targets' bodies on the stable toolchain, without libFuzzer, so that a
//! crash once found stays fixed.

use std::path::Path;

use multicluster_runtime::fuzzing::{TARGETS, run};

#[test]
fn every_committed_fuzz_input_replays_cleanly() {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    for target in TARGETS {
        let dir = seeds.join(target);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "no inputs for {target}");
        for input in inputs {
            let data = std::fs::read(&input).unwrap();
            let replay = std::panic::catch_unwind(|| run(target, &data));
            assert!(
                matches!(replay, Ok(true)),
                "{target}: {} fails",
                input.display()
            );
        }
    }
}

#[test]
fn an_unknown_target_is_reported() {
    assert!(!run("no_such_target", b""));
}
