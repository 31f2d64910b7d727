//! The crate's binaries, built once: the example operator and `mcr`.

/// The example binary, built (or found fresh) in this test's target directory.
pub fn operator_binary() -> std::path::PathBuf {
    built(&["--all-features", "--example", "operator"])
        .join("examples")
        .join("operator")
}

/// `mcr` (cli/), built (or found fresh) in this test's target directory.
pub fn mcr_binary() -> std::path::PathBuf {
    built(&["-p", "multicluster-runtime-cli", "--bin", "mcr"]).join("mcr")
}

/// Runs `cargo build ARGS` into this test's target directory; the profile's directory.
fn built(args: &[&str]) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    let target_dir = profile_dir.parent().unwrap();
    let mut build = std::process::Command::new(env!("CARGO"));
    build
        .arg("build")
        .args(args)
        .arg("--target-dir")
        .arg(target_dir);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "cargo build {args:?}");
    profile_dir
}

/// Runs `mcr ARGS`; its standard output, or a panic with both outputs.
pub fn mcr(binary: &std::path::Path, args: &[&str]) -> String {
    mcr_both(binary, args).0
}

/// Runs `mcr ARGS`, which must fail; its standard error.
pub fn mcr_refused(binary: &std::path::Path, args: &[&str]) -> String {
    let output = std::process::Command::new(binary)
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "mcr {args:?} succeeded: {stderr}");
    stderr
}

/// Runs `mcr ARGS`, which must succeed; its standard output and standard error.
pub fn mcr_both(binary: &std::path::Path, args: &[&str]) -> (String, String) {
    let output = std::process::Command::new(binary)
        .args(args)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    assert!(
        output.status.success(),
        "mcr {args:?} failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}
