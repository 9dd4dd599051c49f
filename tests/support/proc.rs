//! The real `fencegate` binary as a child process, stopped by its own pid.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

/// A scratch directory under the system temp dir, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("fencegate-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The arguments of `fencegate serve` on a free loopback port with `data` as
/// its data directory (and the manual clock if `manual`).
pub fn serve_args(data: &Path, manual: bool) -> Vec<String> {
    let mut args: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--data-dir"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(data.to_string_lossy().into_owned());
    if manual {
        args.extend(["--clock".to_string(), "manual".to_string()]);
    }
    args
}

/// A running `fencegate` process.
pub struct Proc {
    pub child: Child,
    pub url: String,
    /// The rest of stdout: further announced listeners.
    pub stdout: BufReader<ChildStdout>,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `fencegate ARGS…` with stderr to `log` and waits for the
    /// announced address. Panics with the log if it does not start.
    pub fn start<S: AsRef<std::ffi::OsStr>>(args: &[S], log: &Path, env: &[(&str, &str)]) -> Self {
        match Self::try_start(args, log, env) {
            Ok(p) => p,
            Err(msg) => panic!("{msg}"),
        }
    }

    /// Like [`Proc::start`], but returns the exit status and log on failure.
    pub fn try_start<S: AsRef<std::ffi::OsStr>>(
        args: &[S],
        log: &Path,
        env: &[(&str, &str)],
    ) -> Result<Self, String> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fencegate"));
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::options().create(true).append(true).open(log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).unwrap();
        match line
            .trim()
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://") || u.starts_with("https://"))
        {
            Some(url) => Ok(Self {
                child,
                url: url.to_owned(),
                stdout,
                log: log.to_owned(),
            }),
            None => {
                let status = child.wait().unwrap();
                Err(format!(
                    "fencegate did not start ({status}):\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                ))
            }
        }
    }

    /// Sends a signal (e.g. "-KILL", "-TERM", "-STOP") to the process.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new(super::tools::program("kill"))
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill {sig} failed");
    }

    /// SIGKILL, then reap.
    pub fn kill9(mut self) -> ExitStatus {
        self.signal("-KILL");
        self.child.wait().unwrap()
    }

    /// The URL of the next listener announced on stdout (e.g. the admin one).
    pub fn next_url(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim()
            .rsplit(' ')
            .next()
            .unwrap_or_default()
            .to_owned()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `fencegate backend --record` on a free loopback port: a storage with an
/// apply log. Logs to `servers.log` in `dir`.
pub fn recording_backend(dir: &TempDir) -> Proc {
    Proc::start(
        &["backend", "--listen", "127.0.0.1:0", "--record"],
        &dir.path().join("servers.log"),
        &[],
    )
}

/// `fencegate serve` on a free loopback port in front of `upstream`, with
/// its data directory `data` in `dir` and `env` set. Logs to `servers.log`
/// in `dir`.
pub fn proxy_to(dir: &TempDir, upstream: &str, env: &[(&str, &str)]) -> Proc {
    let data = dir.path().join("data");
    Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.path().join("servers.log"),
        env,
    )
}

/// `fencegate serve` with the config file `config` (written as `{name}.toml`
/// in `dir`) on a free loopback port in front of `upstream`, its data
/// directory and log (`{name}.log`) in `dir`, and `mutant` planted
/// (`FENCEGATE_TEST_MUTANT`).
pub fn serve_config(
    dir: &TempDir,
    name: &str,
    config: &str,
    upstream: &str,
    mutant: Option<&str>,
) -> Proc {
    let file = dir.path().join(format!("{name}.toml"));
    std::fs::write(&file, config).unwrap();
    let data = dir.path().join(format!("data-{name}"));
    let env: Vec<(&str, &str)> = mutant
        .map(|m| vec![("FENCEGATE_TEST_MUTANT", m)])
        .unwrap_or_default();
    Proc::start(
        &[
            "serve",
            "--config",
            file.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.path().join(format!("{name}.log")),
        &env,
    )
}
