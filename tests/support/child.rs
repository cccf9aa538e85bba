//! A second process for tests whose point is a real one (a `kill -9`, a lock the system lets
//! go of): this test binary again, running one of its ignored tests.
#![allow(dead_code, unreachable_pub)]

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Runs the ignored test `test` of this binary in a child process with the variable `env`
/// set, and returns it once it printed `ready` on a line of its own, within `wait`. Its
/// standard input is a pipe this side holds: it closes when the parent ends, however it ends.
///
/// # Panics
///
/// When the child cannot start, or is not ready within `wait`.
pub fn spawn(test: &str, env: (&str, &str), ready: &'static str, wait: Duration) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--ignored", "--nocapture"])
        .env(env.0, env.1)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (told, readiness) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            if line.is_ok_and(|line| line.trim() == ready) {
                let _ = told.send(());
            }
        }
    });
    readiness
        .recv_timeout(wait)
        .unwrap_or_else(|_| panic!("the child running {test} is ready within {wait:?}"));
    child
}
