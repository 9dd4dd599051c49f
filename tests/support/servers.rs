//! Real servers for integration tests: nginx with WebDAV, etcd with its v2
//! keys API or its v3 API (plain or TLS), each started on free loopback ports in a temporary
//! directory and stopped by its own process id.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use super::proc::TempDir;
use super::tools::program;

/// A free loopback port (bound and released), never one this process
/// handed out before: the kernel may give a just-released port again, and
/// two servers of one test binary must not be told the same port.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if GIVEN.lock().unwrap().insert(port) {
            return port;
        }
    }
}

/// A server lost the race for its port to another process.
struct PortTaken;

/// How many times a server is started on fresh ports when another process
/// took its port between [`free_port`] and the server's bind.
const START_ATTEMPTS: usize = 3;

/// Waits (bounded, real time: a server starting, not a lease) until `port`
/// accepts connections. `Err(PortTaken)` when the server exited because
/// its port was taken (start it again on other ports); panics on any other
/// failure.
async fn wait_for_port(
    port: u16,
    child: &mut Child,
    what: &str,
    log: &std::path::Path,
) -> Result<(), PortTaken> {
    for _ in 0..500 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            if log.contains("address already in use") || log.contains("Address already in use") {
                eprintln!("{what} found its port taken; starting it again on other ports");
                return Err(PortTaken);
            }
            panic!("{what} exited ({status}): {log}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "{what} did not listen on {port}: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// A running server process, killed by its pid when dropped.
pub struct Server {
    child: Child,
    pub url: String,
    /// Where the server keeps its files (nginx's document root for WebDAV).
    pub root: PathBuf,
    _dir: TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nginx serving WebDAV under `/dav/`, in one process (no daemon, no master).
pub async fn nginx() -> Server {
    nginx_with(None).await
}

/// [`nginx`] over TLS, with this PEM certificate (chain) and key.
pub async fn nginx_tls(cert: &std::path::Path, key: &std::path::Path) -> Server {
    nginx_with(Some((cert, key))).await
}

async fn nginx_with(tls: Option<(&std::path::Path, &std::path::Path)>) -> Server {
    let bin = program("nginx");
    let dir = TempDir::new("nginx");
    let d = dir.path().to_owned();
    let root = d.join("www");
    std::fs::create_dir_all(root.join("dav")).unwrap();
    let log = d.join("error.log");
    for _ in 0..START_ATTEMPTS {
        let port = free_port();
        std::fs::write(d.join("nginx.conf"), nginx_conf(&d, &root, port, tls)).unwrap();
        let _ = std::fs::remove_file(&log);
        let mut child = Command::new(&bin)
            .arg("-p")
            .arg(&d)
            .arg("-c")
            .arg(d.join("nginx.conf"))
            .arg("-e")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if wait_for_port(port, &mut child, "nginx", &log)
            .await
            .is_err()
        {
            continue;
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        return Server {
            child,
            url: format!("{scheme}://127.0.0.1:{port}"),
            root,
            _dir: dir,
        };
    }
    panic!("nginx found its port taken {START_ATTEMPTS} times");
}

/// Garage, an S3-compatible object store (built by [`cargo_tool`]), as
/// one node with one bucket, `orders-bucket`, that [`GARAGE_KEY`] may read
/// and write; it checks every request's SigV4 signature.
pub struct Garage {
    pub server: Server,
    /// The region requests must be signed for.
    pub region: &'static str,
}

/// The access key id and secret the tests' Garage knows.
pub const GARAGE_KEY: (&str, &str) = (
    "GK0123456789abcdef01234567",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
);

/// Starts [`Garage`] on free loopback ports.
pub async fn garage() -> Garage {
    let bin = super::tools::cargo_tool("garage", "2.5.0");
    let dir = TempDir::new("garage");
    let d = dir.path().to_owned();
    let config = d.join("garage.toml");
    let log = d.join("garage.log");
    let garage = |args: &[&str]| {
        let out = Command::new(&bin)
            .arg("-c")
            .arg(&config)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "garage {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for _ in 0..START_ATTEMPTS {
        let (s3, rpc, admin) = (free_port(), free_port(), free_port());
        std::fs::write(
            &config,
            format!(
                "metadata_dir = \"{d}/meta\"\ndata_dir = \"{d}/data\"\ndb_engine = \"sqlite\"\n\
                 replication_factor = 1\nrpc_bind_addr = \"127.0.0.1:{rpc}\"\n\
                 rpc_public_addr = \"127.0.0.1:{rpc}\"\nrpc_secret = \"{secret}\"\n\
                 [s3_api]\ns3_region = \"garage\"\napi_bind_addr = \"127.0.0.1:{s3}\"\n\
                 [admin]\napi_bind_addr = \"127.0.0.1:{admin}\"\n",
                d = d.display(),
                secret = "ab".repeat(32),
            ),
        )
        .unwrap();
        let mut child = Command::new(&bin)
            .arg("-c")
            .arg(&config)
            .arg("server")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        if wait_for_port(s3, &mut child, "garage", &log).await.is_err() {
            continue;
        }
        let server = Server {
            child,
            url: format!("http://127.0.0.1:{s3}"),
            root: d.clone(),
            _dir: dir,
        };
        let id = garage(&["node", "id", "-q"]);
        let id = id.trim().split('@').next().unwrap_or_default().to_owned();
        garage(&["layout", "assign", "-z", "dc1", "-c", "1G", &id]);
        garage(&["layout", "apply", "--version", "1"]);
        garage(&["bucket", "create", "orders-bucket"]);
        let (key_id, secret) = GARAGE_KEY;
        garage(&["key", "import", "--yes", "-n", "tests", key_id, secret]);
        garage(&[
            "bucket",
            "allow",
            "--read",
            "--write",
            "--owner",
            "orders-bucket",
            "--key",
            "tests",
        ]);
        return Garage {
            server,
            region: "garage",
        };
    }
    panic!("garage found its port taken {START_ATTEMPTS} times");
}

/// Starts `command` (its stderr and stdout to `log`) and waits for it to
/// listen on `port`; `None` if another process took the port first.
async fn start_listening(
    mut command: Command,
    port: u16,
    what: &str,
    log: &std::path::Path,
) -> Option<Child> {
    let out = std::fs::File::create(log).unwrap();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    match wait_for_port(port, &mut child, what, log).await {
        Ok(()) => Some(child),
        Err(PortTaken) => None,
    }
}

/// moto's S3 server (`moto_server`, from the S3 venv), in memory, on a
/// free loopback port. It takes unsigned requests and evaluates
/// `If-Match` and `If-None-Match` on PutObject and DeleteObject (not on
/// CompleteMultipartUpload or CopyObject: tests/preconditions_storage.rs
/// measures it).
pub async fn moto() -> Server {
    let venv = s3_client_venv();
    let dir = TempDir::new("moto");
    let log = dir.path().join("moto.log");
    for _ in 0..START_ATTEMPTS {
        let port = free_port();
        let mut command = Command::new(venv.join("bin/moto_server"));
        command
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .current_dir(dir.path());
        if let Some(child) = start_listening(command, port, "moto_server", &log).await {
            return Server {
                child,
                url: format!("http://127.0.0.1:{port}"),
                root: dir.path().to_owned(),
                _dir: dir,
            };
        }
    }
    panic!("moto_server found its port taken {START_ATTEMPTS} times");
}

/// The well-known account of Azure's storage emulators: name and key.
pub const AZURITE_ACCOUNT: (&str, &str) = (
    "devstoreaccount1",
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==",
);

/// Azurite's Blob service (npm `azurite`, pinned in `tests/azurite/`), in
/// memory, on a free loopback port; its URL is the service's, the account
/// is the first path segment (`{url}/devstoreaccount1/container/blob`).
/// Its entity tags change on every write, and it checks every request's
/// Shared Key or SAS signature.
pub async fn azurite() -> Server {
    let packages = super::tools::npm_packages(
        "azurite",
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/azurite"),
    );
    let node = program("node");
    let dir = TempDir::new("azurite");
    let log = dir.path().join("azurite.log");
    for _ in 0..START_ATTEMPTS {
        let port = free_port();
        let mut command = Command::new(&node);
        command
            .arg(packages.join("node_modules/azurite/dist/src/blob/main.js"))
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .args(["--inMemoryPersistence", "--disableTelemetry", "--silent"])
            .current_dir(dir.path());
        if let Some(child) = start_listening(command, port, "azurite", &log).await {
            return Server {
                child,
                url: format!("http://127.0.0.1:{port}"),
                root: dir.path().to_owned(),
                _dir: dir,
            };
        }
    }
    panic!("azurite found its port taken {START_ATTEMPTS} times");
}

/// The test venv made from `tests/s3/requirements.txt` (boto3, moto).
pub fn s3_client_venv() -> PathBuf {
    let requirements =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/s3/requirements.txt");
    super::tools::python_venv("s3", &requirements)
}

/// nginx's configuration: files under `d`, WebDAV under `root`, listening
/// on `port` (TLS with this certificate and key when given).
fn nginx_conf(
    d: &std::path::Path,
    root: &std::path::Path,
    port: u16,
    tls: Option<(&std::path::Path, &std::path::Path)>,
) -> String {
    format!(
        r#"daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    client_max_body_size 64m;
    server {{
        listen 127.0.0.1:{port}{ssl};
        {certs}
        root {root};
        location /dav/ {{
            dav_methods PUT DELETE MKCOL COPY MOVE;
            create_full_put_path on;
            dav_access user:rw group:r all:r;
        }}
    }}
}}
"#,
        d = d.display(),
        root = root.display(),
        ssl = if tls.is_some() { " ssl" } else { "" },
        certs = tls.map_or(String::new(), |(cert, key)| format!(
            "ssl_certificate {}; ssl_certificate_key {};",
            cert.display(),
            key.display()
        )),
    )
}

/// A servlet key-value store on embedded Tomcat (Debian's libtomcat10-java;
/// `tests/support/tomcat/KvStore.java`, compiled here with javac): it keys
/// values by the path a servlet sees, after Tomcat dropped `;parameters` and
/// resolved dot segments.
pub async fn tomcat() -> Server {
    let java = program("java");
    let javac = program("javac");
    let catalina = program("tomcat10-catalina.jar");
    // Every Tomcat 10 jar under its unversioned name.
    let jars: Vec<PathBuf> = std::fs::read_dir(catalina.parent().unwrap())
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            let Some(stem) = name
                .strip_prefix("tomcat10-")
                .and_then(|n| n.strip_suffix(".jar"))
            else {
                return false;
            };
            // tomcat10-util.jar, not tomcat10-util-10.1.52.jar.
            !stem
                .rsplit('-')
                .next()
                .unwrap()
                .starts_with(|c: char| c.is_ascii_digit())
        })
        .collect();
    let classpath = std::env::join_paths(&jars).unwrap();
    let dir = TempDir::new("tomcat");
    let d = dir.path().to_owned();
    let source =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/tomcat/KvStore.java");
    let classes = d.join("classes");
    let compiled = Command::new(&javac)
        .arg("-cp")
        .arg(&classpath)
        .arg("-d")
        .arg(&classes)
        .arg(&source)
        .output()
        .unwrap();
    assert!(
        compiled.status.success(),
        "javac failed: {}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let mut run_classpath = std::ffi::OsString::from(&classpath);
    run_classpath.push(":");
    run_classpath.push(&classes);
    let log = d.join("tomcat.log");
    for _ in 0..START_ATTEMPTS {
        let port = free_port();
        let out = std::fs::File::create(&log).unwrap();
        let mut child = Command::new(&java)
            .arg("-cp")
            .arg(&run_classpath)
            .arg("KvStore")
            .arg(port.to_string())
            .arg(d.join("base"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        if wait_for_port(port, &mut child, "tomcat", &log)
            .await
            .is_err()
        {
            continue;
        }
        return Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            root: d.clone(),
            _dir: dir,
        };
    }
    panic!("tomcat found its port taken {START_ATTEMPTS} times");
}

/// A single-node etcd with the v2 keys API enabled.
pub async fn etcd() -> Server {
    let (child, dir, client, log) = start_etcd("http", &["--enable-v2"]).await;
    let url = format!("http://127.0.0.1:{client}");
    // The client port opens before the member is ready to serve keys.
    let c = super::HttpClient::new(&url);
    for _ in 0..500 {
        if let Ok(r) = c.try_send(super::Req::new("GET", "/v2/keys/")).await {
            if r.status == 200 {
                return Server {
                    child,
                    url,
                    root: dir.path().to_owned(),
                    _dir: dir,
                };
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "etcd never served keys: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

/// A single-node etcd serving its v3 API, over TLS with a certificate
/// `ca` signed when given.
pub async fn etcd_v3(ca: Option<&TestCa>) -> Server {
    let scheme = if ca.is_some() { "https" } else { "http" };
    let tls_args: Vec<String> = match ca {
        Some(ca) => vec![
            "--cert-file".into(),
            ca.cert.to_string_lossy().into_owned(),
            "--key-file".into(),
            ca.key.to_string_lossy().into_owned(),
        ],
        None => Vec::new(),
    };
    let args: Vec<&str> = tls_args.iter().map(String::as_str).collect();
    let (child, dir, client, log) = start_etcd(scheme, &args).await;
    let url = format!("{scheme}://127.0.0.1:{client}");
    let options = fencegate::etcd::EtcdOptions {
        ca_file: ca.map(|ca| ca.ca.clone()),
        user: None,
        timeout_ms: 2000,
    };
    let c = fencegate::etcd::EtcdClient::new(std::slice::from_ref(&url), &options).unwrap();
    // The client port opens before the member has a leader.
    for _ in 0..500 {
        if c.get(b"/").await.is_ok() {
            return Server {
                child,
                url,
                root: dir.path().to_owned(),
                _dir: dir,
            };
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "etcd never served its v3 API: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

/// [`spawn_etcd`] until its client port accepts connections.
async fn start_etcd(scheme: &str, extra: &[&str]) -> (Child, TempDir, u16, PathBuf) {
    for _ in 0..START_ATTEMPTS {
        let (mut child, dir, client, log) = spawn_etcd(scheme, extra);
        if wait_for_port(client, &mut child, "etcd", &log)
            .await
            .is_ok()
        {
            return (child, dir, client, log);
        }
    }
    panic!("etcd found its port taken {START_ATTEMPTS} times");
}

/// Starts a one-member etcd whose client URL has `scheme`, with `extra`
/// arguments: the process, its directory, its client port and its log.
fn spawn_etcd(scheme: &str, extra: &[&str]) -> (Child, TempDir, u16, PathBuf) {
    let bin = program("etcd");
    let dir = TempDir::new("etcd");
    let d = dir.path().to_owned();
    let (client, peer) = (free_port(), free_port());
    let log = d.join("etcd.log");
    let child = Command::new(bin)
        .args(["--name", "test", "--data-dir"])
        .arg(d.join("data"))
        .args([
            "--listen-client-urls",
            &format!("{scheme}://127.0.0.1:{client}"),
            "--advertise-client-urls",
            &format!("{scheme}://127.0.0.1:{client}"),
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-cluster",
            &format!("test=http://127.0.0.1:{peer}"),
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    (child, dir, client, log)
}

/// A test CA and a certificate for 127.0.0.1 it signed, as PEM files.
pub struct TestCa {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// Writes the CA certificate, the server certificate and its key to
    /// `dir`.
    pub fn new(dir: &std::path::Path) -> Self {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        let test_ca = Self {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
        };
        std::fs::write(&test_ca.ca, ca.pem()).unwrap();
        std::fs::write(&test_ca.cert, cert.pem()).unwrap();
        std::fs::write(&test_ca.key, key.serialize_pem()).unwrap();
        test_ca
    }
}

/// A multi-member etcd cluster on loopback ports; members can be stopped
/// and started again (with their data) to take quorum away and back.
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
    _dir: TempDir,
}

struct EtcdMember {
    args: Vec<String>,
    client: u16,
    log: PathBuf,
    child: Option<Child>,
}

impl EtcdCluster {
    /// Starts `n` members and waits until the cluster serves its v3 API.
    pub async fn start(n: usize) -> Self {
        for _ in 0..START_ATTEMPTS {
            if let Some(cluster) = Self::try_start(n).await {
                return cluster;
            }
        }
        panic!("the etcd cluster found its ports taken {START_ATTEMPTS} times");
    }

    async fn try_start(n: usize) -> Option<Self> {
        let dir = TempDir::new("etcd-cluster");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members: Vec<EtcdMember> = ports
            .iter()
            .enumerate()
            .map(|(i, &(client, peer))| {
                let d = dir.path().join(format!("e{i}"));
                std::fs::create_dir_all(&d).unwrap();
                let args = [
                    "--name".to_owned(),
                    format!("e{i}"),
                    "--data-dir".to_owned(),
                    d.join("data").to_string_lossy().into_owned(),
                    "--listen-client-urls".to_owned(),
                    format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls".to_owned(),
                    format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls".to_owned(),
                    format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls".to_owned(),
                    format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster".to_owned(),
                    initial.clone(),
                    "--initial-cluster-token".to_owned(),
                    "fencegate-test".to_owned(),
                ]
                .to_vec();
                EtcdMember {
                    args,
                    client,
                    log: d.join("etcd.log"),
                    child: None,
                }
            })
            .collect();
        for m in &mut members {
            m.spawn();
        }
        for m in &mut members {
            let child = m.child.as_mut().unwrap();
            if wait_for_port(m.client, child, "etcd", &m.log)
                .await
                .is_err()
            {
                return None;
            }
        }
        let cluster = Self { members, _dir: dir };
        cluster.wait_ready().await;
        Some(cluster)
    }

    /// The client URLs, comma-separated.
    pub fn endpoints(&self) -> String {
        self.urls().join(",")
    }

    pub fn urls(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client))
            .collect()
    }

    /// Kills member `i` (SIGKILL).
    pub fn stop(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again with its data, and waits until the cluster
    /// serves.
    pub async fn restart(&mut self, i: usize) {
        self.members[i].spawn();
        self.wait_ready().await;
    }

    /// Stops every member, starts them all again with their data, and waits
    /// until the cluster serves.
    pub async fn restart_all(&mut self) {
        for i in 0..self.members.len() {
            self.stop(i);
        }
        for m in &mut self.members {
            m.spawn();
        }
        self.wait_ready().await;
    }

    /// Waits until a write through the v3 API succeeds at some member
    /// (bounded, real time: a cluster electing its leader).
    async fn wait_ready(&self) {
        let options = fencegate::etcd::EtcdOptions {
            timeout_ms: 1000,
            ..Default::default()
        };
        let c = fencegate::etcd::EtcdClient::new(&self.urls(), &options).unwrap();
        for _ in 0..300 {
            if c.put(b"/test/ready", b"1", 0).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let logs: String = self
            .members
            .iter()
            .map(|m| std::fs::read_to_string(&m.log).unwrap_or_default())
            .collect();
        panic!("the etcd cluster never served: {logs}");
    }
}

impl EtcdMember {
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(program("etcd"))
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.stop(i);
        }
    }
}

/// A TCP relay to `target` that the test can freeze: existing connections
/// are cut and new ones are accepted and never answered, as if the network
/// between a member and etcd went silent.
pub struct Relay {
    pub url: String,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    links: std::sync::Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Relays a loopback port to `target` (`http://127.0.0.1:PORT`).
    pub async fn start(target: &str) -> Self {
        use std::sync::atomic::Ordering;
        let target = target.trim_start_matches("http://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let frozen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let links = std::sync::Arc::new(Mutex::new(Vec::new()));
        let (f, l) = (frozen.clone(), links.clone());
        let task = tokio::spawn(async move {
            let mut silent = Vec::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                if f.load(Ordering::Acquire) {
                    // Held open, never read: calls through it time out.
                    silent.push(inbound);
                    continue;
                }
                let target = target.clone();
                let link = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                l.lock().unwrap().push(link.abort_handle());
            }
        });
        Self {
            url,
            frozen,
            links,
            task,
        }
    }

    /// Cuts every connection and answers no new one.
    pub fn freeze(&self) {
        self.frozen
            .store(true, std::sync::atomic::Ordering::Release);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.freeze();
    }
}
