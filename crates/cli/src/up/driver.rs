//! The launcher's I/O around the pure [`Supervisor`]: starts each child in its own process
//! group with piped output, forwards the output line by line with the child's name as a
//! prefix (and appends it to the child's log file), waits for exits, turns Ctrl-C /
//! SIGTERM / SIGHUP into stop requests, signals process groups, and watches the API until
//! it answers.
//!
//! Threads: the main thread owns the supervisor and every decision; one thread reads the
//! signals; each child has a waiter thread and two forwarding threads; one thread polls
//! the API. They talk to the main thread over one channel.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::local::ChildSpec;
use super::supervisor::{Action, ChildId, Event, Note, Policy, Supervisor, Termination};
use tessera_comm::certs::Identity;

/// The prefix of the launcher's own lines.
pub const ME: &str = "[tessera up]";

/// How long the API has to answer `/health` before the launcher says it is late (it keeps
/// waiting): loading a model's metadata and binding sockets takes seconds, a build of the
/// binaries in debug mode a little more.
const HEALTH_PATIENCE: Duration = Duration::from_secs(120);
/// How often the waiting is reported.
const STATUS_EVERY: Duration = Duration::from_secs(10);
/// How long a child's last output may take to arrive after it exited, before its exit is
/// reported anyway (a grandchild may hold the pipe open).
const DRAIN_WAIT: Duration = Duration::from_secs(1);

/// What to run and how.
#[derive(Debug)]
pub struct Launch {
    pub children: Vec<ChildSpec>,
    pub policy: Policy,
    /// One `<identity>.log` per child.
    pub logs_dir: PathBuf,
    /// Set in every child's environment.
    pub env: Vec<(OsString, OsString)>,
    /// The local coordinator's API, to wait for and announce.
    pub api: Option<Api>,
}

/// Where the API answers, and a model for the example request.
#[derive(Clone, Debug)]
pub struct Api {
    /// `http://host:port`, no trailing `/`.
    pub url: String,
    pub model: String,
}

/// What the helper threads report.
#[derive(Debug)]
enum Msg {
    Exited {
        child: ChildId,
        termination: Termination,
    },
    Stop,
}

/// The environment children get besides ours: `TESSERA_LOG=info` unless set, and no ANSI
/// colors when our output is not a terminal (it goes to a file or a test's pipe).
pub fn child_env() -> Vec<(OsString, OsString)> {
    let mut env = Vec::new();
    if std::env::var_os("TESSERA_LOG").is_none() {
        env.push(("TESSERA_LOG".into(), "info".into()));
    }
    if std::env::var_os("NO_COLOR").is_none() && !std::io::stderr().is_terminal() {
        env.push(("NO_COLOR".into(), "1".into()));
    }
    env
}

/// Runs the children until a stop request and every child is gone.
pub fn run(launch: Launch) -> anyhow::Result<ExitCode> {
    let (tx, rx) = mpsc::channel();
    // Before any child exists, so no signal is missed; the children get the default
    // handlers back at exec.
    let mut signals =
        Signals::new([SIGINT, SIGTERM, SIGHUP]).context("installing the signal handlers")?;
    let signal_tx = tx.clone();
    thread::spawn(move || {
        for _ in signals.forever() {
            if signal_tx.send(Msg::Stop).is_err() {
                break;
            }
        }
    });
    std::fs::create_dir_all(&launch.logs_dir)
        .with_context(|| format!("creating {}", launch.logs_dir.display()))?;

    let stopping = Arc::new(AtomicBool::new(false));
    if let Some(api) = launch.api.clone() {
        let stopping = Arc::clone(&stopping);
        thread::spawn(move || watch_api(&api, &stopping));
    }
    let width = launch
        .children
        .iter()
        .map(|c| c.name.len() + 2)
        .max()
        .unwrap_or(0);
    let mut driver = Driver {
        launch: &launch,
        tx,
        pids: vec![None; launch.children.len()],
        width,
    };
    // Coordinators first: they drain their requests while the shards still run them.
    let tiers: Vec<u32> = launch
        .children
        .iter()
        .map(|c| u32::from(!matches!(c.identity, Identity::Coordinator(_))))
        .collect();
    let mut supervisor = Supervisor::new(launch.children.len(), launch.policy).with_tiers(&tiers);
    let mut actions = supervisor.start(Instant::now());
    loop {
        for action in std::mem::take(&mut actions) {
            if let Some(code) = driver.perform(action, &mut supervisor, &mut actions) {
                return Ok(code);
            }
        }
        if !actions.is_empty() {
            continue;
        }
        let event = next_event(&rx, supervisor.next_wakeup())?;
        let now = Instant::now();
        if let Some(event) = event {
            match event {
                Msg::Exited { child, termination } => {
                    driver.pids[child.0] = None;
                    actions.extend(supervisor.handle(Event::Exited { child, termination }, now));
                }
                Msg::Stop => {
                    stopping.store(true, Ordering::Relaxed);
                    actions.extend(supervisor.handle(Event::StopRequested, now));
                }
            }
        }
        actions.extend(supervisor.handle(Event::Tick, now));
    }
}

/// The next message, or `None` when `wakeup` came first.
fn next_event(rx: &Receiver<Msg>, wakeup: Option<Instant>) -> anyhow::Result<Option<Msg>> {
    let received = match wakeup {
        Some(at) => rx.recv_timeout(at.saturating_duration_since(Instant::now())),
        None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
    };
    match received {
        Ok(msg) => Ok(Some(msg)),
        Err(RecvTimeoutError::Timeout) => Ok(None),
        // The main thread holds a sender: this cannot happen while it runs.
        Err(RecvTimeoutError::Disconnected) => anyhow::bail!("the launcher's event channel closed"),
    }
}

struct Driver<'a> {
    launch: &'a Launch,
    tx: Sender<Msg>,
    /// The process group of each running child (its leader's pid).
    pids: Vec<Option<Pid>>,
    /// Width of the `[name]` prefixes.
    width: usize,
}

impl Driver<'_> {
    /// Carries out one action; more may follow (a failed spawn). `Some` to exit.
    fn perform(
        &mut self,
        action: Action,
        supervisor: &mut Supervisor,
        more: &mut Vec<Action>,
    ) -> Option<ExitCode> {
        match action {
            Action::Spawn(child) => match self.spawn(child) {
                Ok(pid) => self.pids[child.0] = Some(pid),
                Err(error) => {
                    eprintln!("{ME} {}: {error:#}", self.name(child));
                    let event = Event::Exited {
                        child,
                        termination: Termination::NotStarted,
                    };
                    more.extend(supervisor.handle(event, Instant::now()));
                }
            },
            Action::Terminate(child) => self.signal(child, Signal::SIGTERM),
            Action::Kill(child) => self.signal(child, Signal::SIGKILL),
            Action::Note(note) => eprintln!("{ME} {}", self.describe(&note)),
            Action::Exit => {
                eprintln!("{ME} stopped");
                return Some(ExitCode::SUCCESS);
            }
        }
        None
    }

    fn name(&self, child: ChildId) -> &str {
        &self.launch.children[child.0].name
    }

    fn signal(&self, child: ChildId, signal: Signal) {
        if let Some(pid) = self.pids[child.0] {
            // ESRCH: the group is already gone; its exit report is on its way.
            let _ = killpg(pid, signal);
        }
    }

    fn describe(&self, note: &Note) -> String {
        match note {
            Note::Crashed {
                child,
                termination,
                ran,
                restart_in,
                restarts,
            } => format!(
                "{} ended after {:.1} s: {termination}; restart {restarts} in {} s",
                self.name(*child),
                ran.as_secs_f64(),
                restart_in.as_secs()
            ),
            Note::Stopped { child, termination } => {
                format!("{} stopped: {termination}", self.name(*child))
            }
            Note::Stopping { running, grace } => format!(
                "stopping: SIGTERM to {running} process group(s), {} s before SIGKILL \
                 (Ctrl-C again to kill now)",
                grace.as_secs_f64()
            ),
            Note::GraceOver { left } => {
                format!("grace period over: SIGKILL to {left} process group(s)")
            }
            Note::KillNow { left } => format!("SIGKILL to {left} process group(s)"),
        }
    }

    /// Starts `child` in a new process group, with its output forwarded and a waiter.
    fn spawn(&self, id: ChildId) -> anyhow::Result<Pid> {
        let spec = &self.launch.children[id.0];
        let log_path = self.launch.logs_dir.join(spec.log_name());
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let mut child = Command::new(&spec.program)
            .args(&spec.args)
            .envs(self.launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", spec.command_line()))?;
        let pid = Pid::from_raw(i32::try_from(child.id()).context("pid out of range")?);
        let _ = writeln!(log, "=== {ME}: started pid {pid}: {}", spec.command_line());
        let log = Arc::new(Mutex::new(log));
        let prefix = format!(
            "{:<width$} ",
            format!("[{}]", spec.name),
            width = self.width
        );
        let (done_tx, done_rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            let (prefix, log, done) = (prefix.clone(), Arc::clone(&log), done_tx.clone());
            thread::spawn(move || forward(out, &prefix, Stream::Stdout, &log, &done));
        }
        if let Some(err) = child.stderr.take() {
            let (prefix, log, done) = (prefix, Arc::clone(&log), done_tx);
            thread::spawn(move || forward(err, &prefix, Stream::Stderr, &log, &done));
        }
        let tx = self.tx.clone();
        thread::spawn(move || wait(child, id, &done_rx, &tx));
        Ok(pid)
    }
}

#[derive(Clone, Copy, Debug)]
enum Stream {
    Stdout,
    Stderr,
}

/// Copies `from` line by line to our `to`, each line after `prefix`, and to the log file.
fn forward(from: impl Read, prefix: &str, to: Stream, log: &Mutex<File>, done: &Sender<()>) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        let mut out = Vec::with_capacity(prefix.len() + line.len());
        out.extend_from_slice(prefix.as_bytes());
        out.extend_from_slice(&line);
        // One write per line, under the lock, so lines of different children never mix.
        let _ = match to {
            Stream::Stdout => std::io::stdout().lock().write_all(&out),
            Stream::Stderr => std::io::stderr().lock().write_all(&out),
        };
        if let Ok(mut file) = log.lock() {
            let _ = file.write_all(&line);
        }
    }
    let _ = done.send(());
}

/// Waits for `child` to end, lets its last output through, and reports the exit.
fn wait(mut child: Child, id: ChildId, output_done: &Receiver<()>, tx: &Sender<Msg>) {
    let termination = match child.wait() {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(code), _) => Termination::Code(code),
            (None, Some(signal)) => Termination::Signal(signal),
            (None, None) => Termination::Code(-1),
        },
        Err(_) => Termination::Code(-1),
    };
    let deadline = Instant::now() + DRAIN_WAIT;
    for _ in 0..2 {
        if output_done
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    let _ = tx.send(Msg::Exited {
        child: id,
        termination,
    });
}

/// Polls `/health` until it answers, announces the API, then polls `/ready` until every
/// model can generate. Gives up quietly once the launcher is stopping.
fn watch_api(api: &Api, stopping: &AtomicBool) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    let answers = |path: &str| {
        agent
            .get(format!("{}{path}", api.url))
            .call()
            .is_ok_and(|r| r.status() == 200)
    };
    let start = Instant::now();
    let mut next_status = start + STATUS_EVERY;
    let mut late = false;
    while !answers("/health") {
        if stopping.load(Ordering::Relaxed) {
            return;
        }
        let waited = start.elapsed();
        if !late && waited >= HEALTH_PATIENCE {
            late = true;
            eprintln!(
                "{ME} the coordinator has not answered {}/health after {} s; still waiting \
                 (its log lines above say why)",
                api.url,
                waited.as_secs()
            );
        } else if !late && Instant::now() >= next_status {
            eprintln!(
                "{ME} waiting for the coordinator at {} ({} s)",
                api.url,
                waited.as_secs()
            );
            next_status += STATUS_EVERY;
        }
        thread::sleep(Duration::from_millis(250));
    }
    let banner = format!(
        "\nTessera API: {url}\n  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\\n    \
         -d '{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'\n  \
         tessera generate --url {url} --prompt \"The capital of France is\"\n",
        url = api.url,
        model = api.model,
    );
    let _ = std::io::stdout().lock().write_all(banner.as_bytes());
    while !answers("/ready") {
        if stopping.load(Ordering::Relaxed) {
            return;
        }
        thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "{ME} ready: every model can generate ({:.1} s after start)",
        start.elapsed().as_secs_f64()
    );
}
