//! Headless Chromium driven over the DevTools protocol, for tests that check
//! what a person would see. The protocol runs over a pipe
//! (`--remote-debugging-pipe`: fd 3 carries commands in, fd 4 answers out,
//! each message JSON ended by a NUL byte), so no port and no WebSocket.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

use fencegate::clock::Stopwatch;

use base64::Engine;
use serde_json::{json, Value};

use super::proc::TempDir;
use super::tools;

/// How long one protocol command may take before the test fails. Wide:
/// Chromium's first start on a loaded two-core machine takes seconds.
const ANSWER_WITHIN: Duration = Duration::from_secs(60);

/// One headless Chromium with one page open.
pub struct Browser {
    child: Child,
    commands: File,
    answers: Receiver<Value>,
    next_id: u64,
    session: String,
    _profile: TempDir,
}

/// A pipe: (read end, write end), both close-on-exec.
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid two-int array; on success both fds are new
    // and owned by nobody else.
    #[allow(unsafe_code)]
    unsafe {
        assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0, "pipe2");
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    }
}

impl Browser {
    /// Starts Chromium (installing it first if it is missing) and opens
    /// `url` in a page of `width` × `height` CSS pixels.
    pub fn open(url: &str, width: u32, height: u32) -> Self {
        use std::os::fd::AsRawFd;
        let chromium = tools::program("chromium");
        let profile = TempDir::new("chromium");
        let (their_in, our_out) = pipe();
        let (our_in, their_out) = pipe();
        let (fd_in, fd_out) = (their_in.as_raw_fd(), their_out.as_raw_fd());
        let mut command = Command::new(chromium);
        command
            .args([
                "--headless",
                // The tests run as root, where Chromium's sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A process group of its own (its id is the browser's pid), so
            // that stopping it stops its helper processes too.
            .process_group(0);
        // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork
        // and exec. The pipe ends are first copied above 3 and 4, so that
        // neither dup2 overwrites the other's source or is a no-op (which
        // would leave the close-on-exec flag set).
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(move || {
                let high_in = libc::fcntl(fd_in, libc::F_DUPFD, 10);
                let high_out = libc::fcntl(fd_out, libc::F_DUPFD, 10);
                if high_in < 0
                    || high_out < 0
                    || libc::dup2(high_in, 3) < 0
                    || libc::dup2(high_out, 4) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(high_in);
                libc::close(high_out);
                Ok(())
            });
        }
        let child = command.spawn().expect("start chromium");
        drop((their_in, their_out));
        let (tx, answers) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(File::from(our_in));
            let mut message = Vec::new();
            while reader.read_until(0, &mut message).unwrap_or(0) > 0 {
                message.pop_if(|b| *b == 0);
                if let Ok(value) = serde_json::from_slice::<Value>(&message) {
                    if tx.send(value).is_err() {
                        break;
                    }
                }
                message.clear();
            }
        });
        let mut browser = Self {
            child,
            commands: File::from(our_out),
            answers,
            next_id: 0,
            session: String::new(),
            _profile: profile,
        };
        let target = browser.call("Target.createTarget", json!({ "url": "about:blank" }));
        let target_id = target["targetId"].as_str().expect("targetId").to_owned();
        let attached = browser.call(
            "Target.attachToTarget",
            json!({ "targetId": target_id, "flatten": true }),
        );
        browser.session = attached["sessionId"]
            .as_str()
            .expect("sessionId")
            .to_owned();
        browser.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false }),
        );
        let navigated = browser.call("Page.navigate", json!({ "url": url }));
        if let Some(error) = navigated.get("errorText") {
            panic!("chromium could not open {url}: {error}");
        }
        browser.wait_for(
            "document.readyState === 'complete'",
            Duration::from_secs(60),
        );
        browser
    }

    /// Sends a protocol command (to the page once attached) and returns its
    /// result; panics on a protocol error or no answer in time.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if !self.session.is_empty() {
            message["sessionId"] = self.session.clone().into();
        }
        let mut bytes = serde_json::to_vec(&message).expect("json");
        bytes.push(0);
        self.commands.write_all(&bytes).expect("write to chromium");
        let asked = Stopwatch::start();
        loop {
            let left = ANSWER_WITHIN.saturating_sub(Duration::from_millis(asked.elapsed_ms()));
            let answer = self
                .answers
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("chromium did not answer {method}: {e}"));
            if answer["id"] == id {
                if let Some(error) = answer.get("error") {
                    panic!("{method} failed: {error}");
                }
                return answer["result"].clone();
            }
        }
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
        );
        if let Some(exception) = result.get("exceptionDetails") {
            panic!("{expression} threw: {exception}");
        }
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` until it is truthy, and returns that value;
    /// panics after `within`.
    pub fn wait_for(&mut self, expression: &str, within: Duration) -> Value {
        let start = Stopwatch::start();
        loop {
            let value = self.eval(expression);
            let truthy = match &value {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return value;
            }
            assert!(
                Duration::from_millis(start.elapsed_ms()) < within,
                "not seen within {within:?}: {expression}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Writes a PNG of the whole page (beyond the viewport) to `path`.
    pub fn screenshot(&mut self, path: &Path) {
        let shot = self.call(
            "Page.captureScreenshot",
            json!({ "format": "png", "captureBeyondViewport": true }),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("data"))
            .expect("base64");
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The browser's process group, by its own pid, then the browser
        // itself reaped; the profile directory goes once they are gone.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: a plain signal to the group this browser leads.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
