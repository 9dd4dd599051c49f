//! The system programs the test suite runs, installed on demand.
//!
//! `cargo test` is the whole test command: a test that needs a program calls
//! [`program`]. If the program is missing, it is installed with apt-get when
//! the tests run as root on Debian (every missing package at once, after an
//! `apt-get update`, without starting any service), and otherwise the test
//! fails at once with the exact command to run. A missing program never
//! skips a test.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// Every program the suite runs, with the Debian package that has it (a
/// `.jar` is a Java library the tests load, found in `/usr/share/java`; a
/// `.so.1` a library the tests preload, found in `/usr/lib/*/faketime`).
pub const PROGRAMS: [(&str, &str); 14] = [
    ("curl", "curl"),
    ("openssl", "openssl"),
    ("kill", "procps"),
    ("nginx", "nginx"),
    ("etcd", "etcd-server"),
    ("promtool", "prometheus"),
    ("chromium", "chromium"),
    ("java", "default-jre-headless"),
    ("javac", "default-jdk-headless"),
    ("tomcat10-catalina.jar", "libtomcat10-java"),
    ("libfaketimeMT.so.1", "faketime"),
    ("ensurepip", "python3-venv"),
    ("node", "nodejs"),
    ("npm", "npm"),
];

/// Where `name` is installed, if it is: on PATH or in the sbin directories
/// Debian puts servers in (Java libraries: in `/usr/share/java`).
fn find(name: &str) -> Option<PathBuf> {
    if name.ends_with(".jar") {
        return Some(PathBuf::from("/usr/share/java").join(name)).filter(|p| p.is_file());
    }
    if name == "ensurepip" {
        // What `python3 -m venv` needs, and Debian ships apart.
        return std::fs::read_dir("/usr/lib")
            .ok()?
            .flatten()
            .filter(|dir| dir.file_name().to_string_lossy().starts_with("python3"))
            .map(|dir| dir.path().join("ensurepip"))
            .find(|p| p.join("__init__.py").is_file());
    }
    if name.ends_with(".so.1") {
        // Debian's multiarch directory, whatever the machine's triple.
        return std::fs::read_dir("/usr/lib")
            .ok()?
            .flatten()
            .map(|dir| dir.path().join("faketime").join(name))
            .find(|p| p.is_file());
    }
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// The packages of the suite's programs that are missing.
fn missing_packages() -> Vec<&'static str> {
    PROGRAMS
        .iter()
        .filter(|(name, _)| find(name).is_none())
        .map(|(_, package)| *package)
        .collect()
}

/// The path of `name`, one of [`PROGRAMS`], installing what is missing first
/// (see the module docs). Panics with the install command when it cannot.
pub fn program(name: &str) -> PathBuf {
    if let Some(path) = find(name) {
        return path;
    }
    // One installer at a time in this process; apt's own lock keeps other
    // test processes out (they wait for it).
    static INSTALL: Mutex<()> = Mutex::new(());
    let _one = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(path) = find(name) {
        return path;
    }
    let packages = missing_packages();
    let line = format!(
        "apt-get update && apt-get install -y --no-install-recommends {}",
        packages.join(" ")
    );
    if !is_root() || find("apt-get").is_none() {
        panic!(
            "the tests need {name}, which is not installed. Run the tests as root on Debian \
             and they install what is missing, or install it yourself:\n    sudo sh -c '{line}'"
        );
    }
    // Straight to the terminal: the test harness would hold an eprintln!
    // until the test ends, and an install takes minutes.
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "installing what the tests need (a few minutes): {line}"
        );
    }
    install(&packages);
    find(name).unwrap_or_else(|| panic!("{name} is still missing after: {line}"))
}

/// Installs `packages` with apt-get, keeping their services from starting
/// (the tests start their own servers on free ports).
fn install(packages: &[&str]) {
    let policy = std::path::Path::new("/usr/sbin/policy-rc.d");
    let added_policy =
        !policy.exists() && std::fs::write(policy, "#!/bin/sh\nexit 101\n").is_ok() && {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(policy, std::fs::Permissions::from_mode(0o755)).is_ok()
        };
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(["-o", "DPkg::Lock::Timeout=600"])
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    let enabled_before = enabled_services();
    let updated = apt(&["update", "-q"]);
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend_from_slice(packages);
    let installed = apt(&args);
    if added_policy {
        let _ = std::fs::remove_file(policy);
    }
    // Also after a failed install: whatever it enabled is disabled again.
    disable_new_services(&enabled_before);
    assert!(
        installed,
        "apt-get install {} failed (apt-get update {})",
        packages.join(" "),
        if updated { "worked" } else { "failed" }
    );
}

/// The services enabled at boot: the units linked from the `.wants`
/// directories under `/etc/systemd/system`.
fn enabled_services() -> std::collections::BTreeSet<String> {
    let mut units = std::collections::BTreeSet::new();
    let Ok(dirs) = std::fs::read_dir("/etc/systemd/system") else {
        return units;
    };
    for dir in dirs.flatten() {
        if !dir.file_name().to_string_lossy().ends_with(".wants") {
            continue;
        }
        for unit in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = unit.file_name().to_string_lossy().into_owned();
            if name.ends_with(".service") {
                units.insert(name);
            }
        }
    }
    units
}

/// Leaves the services an install enabled (Debian enables nginx, etcd and
/// prometheus at boot; the tests start their own servers) disabled, as they
/// were before it.
fn disable_new_services(before: &std::collections::BTreeSet<String>) {
    let Some(systemctl) = find("systemctl") else {
        return;
    };
    for unit in enabled_services().difference(before) {
        let _ = Command::new(&systemctl)
            .args(["disable", "--quiet", unit])
            .status();
    }
}

/// Where the tools the tests build or download are kept, outside the clone
/// so a second clone finds them made: `FENCEGATE_TEST_CACHE`, else
/// `$XDG_CACHE_HOME/fencegate-tests`, else `~/.cache/fencegate-tests`.
pub fn cache_dir() -> PathBuf {
    let dir = std::env::var_os("FENCEGATE_TEST_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("fencegate-tests"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/fencegate-tests"))
        })
        .unwrap_or_else(|| std::env::temp_dir().join("fencegate-tests-cache"));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

/// Holds the cache's lock for `name` (a file lock, so test processes of
/// other clones making the same tool wait for it) while it lives.
pub fn cache_lock(name: &str) -> std::fs::File {
    let path = cache_dir().join(format!("{name}.lock"));
    let file = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    file.lock()
        .unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
    file
}

/// A Python virtual environment with `requirements` (a pip requirements
/// file) installed, made once in the [`cache_dir`] for each version of the
/// file (never a pip install into the system's Python, which Debian
/// refuses). Its directory.
pub fn python_venv(name: &str, requirements: &std::path::Path) -> PathBuf {
    program("ensurepip");
    let wanted = std::fs::read_to_string(requirements).expect("the requirements file");
    let version = crc32fast::hash(wanted.as_bytes());
    let dir = cache_dir().join(format!("venv-{name}-{version:08x}"));
    let stamp = dir.join("installed-requirements.txt");
    static MAKING: Mutex<()> = Mutex::new(());
    let _one = MAKING.lock().unwrap_or_else(|p| p.into_inner());
    let _all = cache_lock(&format!("venv-{name}"));
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return dir;
    }
    let _ = std::fs::remove_dir_all(&dir);
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "making the test venv {} (pip install -r {})",
            dir.display(),
            requirements.display()
        );
    }
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    assert!(made, "python3 -m venv {} failed", dir.display());
    let installed = Command::new(dir.join("bin/pip"))
        .args(["install", "-q", "--disable-pip-version-check", "-r"])
        .arg(requirements)
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        installed,
        "pip install -r {} failed",
        requirements.display()
    );
    std::fs::write(&stamp, wanted).unwrap();
    dir
}

/// The binary `name` of crate `name` at `version`, built once with `cargo
/// install --locked` in the [`cache_dir`] (so a tool a test needs arrives
/// through cargo, and a later run, or another clone, finds it built). Its
/// path.
pub fn cargo_tool(name: &str, version: &str) -> PathBuf {
    let tools = cache_dir().join("tools");
    let root = tools.join(format!("{name}-{version}"));
    let bin = root.join("bin").join(name);
    static BUILDING: Mutex<()> = Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    let _all = cache_lock(&format!("tool-{name}"));
    if bin.is_file() {
        return bin;
    }
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "building {name} {version} for the tests (cargo install --locked; minutes, once)"
        );
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = Command::new(cargo)
        .args([
            "install",
            "--locked",
            "--quiet",
            name,
            "--version",
            version,
            "--root",
        ])
        .arg(&root)
        .env("CARGO_TARGET_DIR", tools.join("build"))
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        built && bin.is_file(),
        "cargo install {name} --version {version} failed"
    );
    bin
}

/// The npm packages of `dir` (a `package.json` with its `package-lock.json`
/// in the repository), installed once with `npm ci` in the [`cache_dir`]
/// for each version of the lock file. The directory holding their
/// `node_modules`.
pub fn npm_packages(name: &str, dir: &std::path::Path) -> PathBuf {
    let npm = program("npm");
    program("node");
    let manifest = std::fs::read(dir.join("package.json")).expect("package.json");
    let lock = std::fs::read(dir.join("package-lock.json")).expect("package-lock.json");
    let version = crc32fast::hash(&[manifest.as_slice(), lock.as_slice()].concat());
    let out = cache_dir().join(format!("npm-{name}-{version:08x}"));
    let stamp = out.join("installed");
    static INSTALLING: Mutex<()> = Mutex::new(());
    let _one = INSTALLING.lock().unwrap_or_else(|p| p.into_inner());
    let _all = cache_lock(&format!("npm-{name}"));
    if stamp.is_file() {
        return out;
    }
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("package.json"), &manifest).unwrap();
    std::fs::write(out.join("package-lock.json"), &lock).unwrap();
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "installing the npm packages of {} for the tests (npm ci, once)",
            dir.display()
        );
    }
    let installed = Command::new(npm)
        .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
        .current_dir(&out)
        .status()
        .is_ok_and(|s| s.success());
    assert!(installed, "npm ci in {} failed", out.display());
    std::fs::write(&stamp, "").unwrap();
    out
}

/// Whether the tests run as root (some need it: mounting a tmpfs).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    unsafe {
        libc::geteuid() == 0
    }
}
