//! The Python client (`clients/python`), as a user gets it: `pip install`
//! of a copy of the package into a fresh venv, then its type check (`mypy
//! --strict`), its linter (`ruff check`, `ruff format --check`) and its
//! tests (pytest: the real `fencegate` binary alone, in front of moto's S3
//! server, nginx's WebDAV and its embedded store, a three-member cluster
//! with shards over etcd, a holder paused with SIGSTOP, and the README's
//! Python example as printed).
//!
//! The tools (pytest, mypy, ruff, boto3, moto, requests, setuptools) come
//! from a venv made once in the test cache from the pinned
//! `clients/python/tests/requirements.txt`; the fresh venv sees them
//! through a `.pth` file, so it installs nothing from the network.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::proc::TempDir;
use support::tools::{program, python_venv};

/// Proxies would take the tests' loopback traffic elsewhere.
const CLEAN_ENV: [&str; 4] = ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"];

fn run(what: &str, cmd: &mut Command) -> Output {
    for key in CLEAN_ENV {
        cmd.env_remove(key);
    }
    let out = cmd
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The `purelib` directory of the venv whose interpreter is `python`.
fn site_packages(python: &Path) -> PathBuf {
    let out = run(
        "asking a venv for its site-packages",
        Command::new(python).args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ]),
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Copies the package's files (not what a build or a run left) to `to`.
fn copy_package(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == "build"
            || name == "__pycache__"
            || name.ends_with(".egg-info")
            || name.starts_with('.')
        {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            copy_package(&path, &to.join(&*name));
        } else {
            std::fs::copy(&path, to.join(&*name)).unwrap();
        }
    }
}

#[test]
fn the_python_client_installs_type_checks_lints_and_passes_its_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let package = root.join("clients/python");
    let tools = python_venv("python-client", &package.join("tests/requirements.txt"));
    let nginx = program("nginx");
    let etcd = program("etcd");
    let dir = TempDir::new("python-client");

    // A fresh venv, seeing the tools' venv (pip and setuptools too)
    // through a .pth file.
    let venv = dir.path().join("venv");
    run(
        "python3 -m venv",
        Command::new("python3")
            .args(["-m", "venv", "--without-pip"])
            .arg(&venv),
    );
    let python = venv.join("bin/python");
    std::fs::write(
        site_packages(&python).join("fencegate-test-tools.pth"),
        format!("{}\n", site_packages(&tools.join("bin/python")).display()),
    )
    .unwrap();

    // pip install ./clients/python (a copy: a build writes next to it).
    let copy = dir.path().join("package");
    copy_package(&package, &copy);
    run(
        "pip install ./clients/python",
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-index",
                "--no-build-isolation",
            ])
            .arg(&copy),
    );

    let out = run(
        "import fencegate",
        Command::new(&python)
            .args(["-c", "import fencegate; print(fencegate.__file__)"])
            .current_dir(dir.path()),
    );
    let installed = String::from_utf8_lossy(&out.stdout);
    assert!(
        Path::new(installed.trim()).starts_with(&venv),
        "the package imported is not the one installed: {installed}"
    );

    run(
        "mypy --strict",
        Command::new(&python)
            .args(["-m", "mypy", "--strict", "--cache-dir"])
            .arg(dir.path().join("mypy-cache"))
            .arg(copy.join("src/fencegate")),
    );
    run(
        "ruff check",
        Command::new(&python)
            .args(["-m", "ruff", "check", "--no-cache", "src", "tests"])
            .current_dir(&copy),
    );
    run(
        "ruff format --check",
        Command::new(&python)
            .args([
                "-m",
                "ruff",
                "format",
                "--check",
                "--no-cache",
                "src",
                "tests",
            ])
            .current_dir(&copy),
    );

    // The tests, against the installed package (the copy's tests directory
    // holds no `fencegate`; its `src` is not on the path).
    let out = run(
        "pytest",
        Command::new(&python)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
            .current_dir(&copy)
            .env("FENCEGATE_BIN", env!("CARGO_BIN_EXE_fencegate"))
            .env("FENCEGATE_README", root.join("README.md"))
            .env("NGINX", nginx)
            .env("ETCD", etcd),
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains(" passed") && !printed.contains("skipped"),
        "{printed}"
    );
}
