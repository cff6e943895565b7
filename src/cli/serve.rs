//! `kvrecv serve`: a D receiver driven by a host scheduler over a pipe.
//!
//! stdout carries one JSON object per line: `ready` once, then the answer to every input line
//! (`load_kv`, `abort`, `drain`, `stats`, `error`, `shutdown`) and every coordinator event
//! ([`KvEvent`], tagged `event`). stdin carries one JSON command per line:
//! `{"op":"load_kv","requests":[{"req_id","transfer_id","remote_engine_id","remote_bootstrap_addr","block_ids":[[..]]}]}`,
//! `{"op":"abort","req_id":"..."}` (the client went away: as `KvRecv::abort`),
//! `{"op":"drain"}`, `{"op":"stats"}`, `{"op":"shutdown"}` (end of input also shuts down). A bad
//! line (not JSON, not UTF-8, longer than `--max-line-bytes`) gets an `error` line and the
//! process keeps running. Logs go to stderr. `--events` chooses which coordinator events are
//! printed: `all` (default), `completions` (only `completion` lines), `none` (a host that only
//! needs `drain`; the coordinator then produces no events at all). `--answers failures` leaves
//! out the answer to a `load_kv` whose every request was accepted (every other answer is
//! printed): a host that learns of its requests from their completions saves a pipe write, and
//! its own wake-up, per batch.
//!
//! `shutdown` (or the end of input, or SIGTERM/SIGINT) is answered by a last `drain` line when anything was released
//! since the host's last drain, then `{"event":"shutdown","unreleased":N}`: N awaited requests
//! were never released (abandoned in flight).
//!
//! stdout is written through a buffered writer flushed whenever its queue is empty, so a burst
//! of events costs a few `write`s, not a write and a flush per line through tokio's blocking
//! pool. When stdin and stdout are pipes (a host driving serve) both go through the runtime's
//! epoll, on the actors' own thread: no blocking-pool read per chunk of input, no other thread
//! woken per burst of output. Over `--max-output-backlog-bytes` of unwritten output stdin is not
//! read ([`super::serve_output`]).
//!
//! The process is a Mooncake TE target: a handshake daemon (what P's TE reaches through
//! `remote_hostname:remote_port`) and, on TCP, a data server, both bound on `--bind`, with
//! landing permits on unless `--no-permits`. With `--protocol rdma` (feature `rdma`) it is the
//! RDMA target instead. Nothing authenticates either listener: bind the interface P uses, never
//! a public one.
//!
//! serve is a host of the front door: its worker is the one [`KvRecvBuilder`](crate::KvRecvBuilder) wires
//! ([`ServeArgs::builder`]), run on serve's own threads (the data plane on a runtime of its
//! own, the actors and the pipes on this thread) rather than behind a handle.

#![forbid(unsafe_code)]

use std::os::fd::AsFd;
use std::process::ExitCode;
use std::sync::Arc;

use serde_json::json;
use tokio::io::{AsyncRead, BufReader};
use tokio::net::unix::pipe;
use tokio::sync::mpsc::UnboundedReceiver;

use super::event_line::event_line;
use super::line_reader::{Line, LineReader};
use super::serve_answers::{data_plane_stats, drain_line, load_kv_answer, metas, ready_line};
pub use super::serve_args::ServeArgs;
use super::serve_args::{AnswerLevel, EventLevel};
use super::serve_ops::Op;
use super::serve_output::{output, Output, Writer};
use crate::actors::Coordinator;
use crate::embed::{data_runtime, DataPlaneHandle, Wiring};
use crate::messages::{Interner, KvEvent};
use crate::StartError;

fn emit(out: &Output, v: serde_json::Value) {
    out.send(v.to_string());
}

/// stdin: a pipe through the runtime's epoll, anything else through tokio's blocking pool.
fn stdin_reader() -> Box<dyn AsyncRead + Unpin> {
    let pipe = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .and_then(|fd| pipe::Receiver::from_file(std::fs::File::from(fd)));
    match pipe {
        Ok(p) => Box::new(p),
        Err(_) => Box::new(tokio::io::stdin()),
    }
}

/// Run until `shutdown` or end of input.
pub fn run(args: ServeArgs) -> ExitCode {
    super::logging::init(&args.log_level);
    let fail = |e: String| {
        println!("{}", json!({"event": "error", "error": e}));
        ExitCode::from(2)
    };
    let builder = match args.config().and_then(|cfg| args.builder(cfg)) {
        Ok(b) => b,
        Err(e) => return fail(e),
    };
    // The data plane's listeners (handshake daemon, data server) run on a runtime of their own
    // and its connections on threads of their own; the actors and the pipes run on a
    // current-thread runtime on this thread, which polls their sockets itself (one runtime for both made every control-plane wake-up a hop
    // from a worker's epoll to this thread: 15-20% of serve's CPU per request).
    let data_rt = match data_runtime(2, "kvrecv-data") {
        Ok(rt) => rt,
        Err(e) => return fail(format!("data-plane runtime: {e}")),
    };
    // The recorder goes in before any metric handle is taken (the labels' and the target's).
    // The ready line names the address bound (a port 0 resolved), or null if none was.
    let metrics = args.metrics.and_then(|addr| {
        let _in_data_rt = data_rt.enter();
        crate::metrics_endpoint::serve_prometheus(addr)
            .map_err(|e| {
                println!(
                    "{}",
                    json!({"event": "error", "error": format!("metrics: {e}")})
                )
            })
            .ok()
    });
    let wiring = match builder.wire() {
        Ok(w) => w,
        Err(e) => return fail(data_plane_error(e)),
    };
    let Wiring {
        data,
        control,
        events,
        ..
    } = wiring;
    // Its tasks keep running on the data runtime's workers after this returns.
    let (landing, plane, keep) = match data_rt.block_on(data.start()) {
        Ok((landing, Some(plane), keep)) => (landing, plane, keep),
        Ok((_, None, _)) => return fail("data plane: no target started".into()),
        Err(e) => return fail(data_plane_error(e)),
    };
    let sys = actix_rt::System::new();
    // The loop runs as a task on the actors' LocalSet, not as the future `block_on` polls: that
    // future's waker unparks the runtime's driver (an eventfd write, then one more epoll_wait)
    // every time an actor wakes it, i.e. for every load_kv answer and every burst of events.
    let code = sys.block_on(async move {
        let cfg = control.config.clone();
        let labels = control.labels.clone();
        let (coord, control_cpu) = control.coordinator(Arc::clone(&landing));
        let mut ready = ready_line(metrics, &cfg, landing.endpoint(), &plane, control_cpu);
        ready["memory"] = json!(args.gpu.map_or("host".to_owned(), |o| format!("cuda:{o}")));
        let worker = Worker {
            coord,
            plane,
            events,
            pauses: labels.counter(crate::telemetry::STDIN_PAUSES),
        };
        actix_rt::spawn(serve(args, worker, ready))
            .await
            .unwrap_or(ExitCode::from(2))
    });
    // Listeners stop when the target drops, after the actors stopped.
    drop(keep);
    drop(data_rt);
    code
}

/// The `error` line for a data plane that could not start: `data plane: ` and why (a TCP
/// target's error already says `data plane`).
fn data_plane_error(e: StartError) -> String {
    match e {
        StartError::Target(e) => format!("data plane: {e}"),
        e => format!("data plane: {e}"),
    }
}

/// The running worker, as serve's loop sees it.
struct Worker {
    coord: Coordinator,
    /// The data plane, for the `stats` answer.
    plane: DataPlaneHandle,
    /// The coordinator's events (`None` with `--events none`: it builds none).
    events: Option<UnboundedReceiver<KvEvent>>,
    /// Times stdin was paused for a host not reading stdout.
    pauses: metrics::Counter,
}

/// The answer line to one input op (line `n`), `None` when `--answers` leaves it out, and
/// whether it is a drain that handed nothing over; `shutdown` is the caller's.
async fn answer(
    op: Op<'_>,
    n: u64,
    worker: &Worker,
    session: &mut Session,
) -> (Option<String>, bool) {
    let v = match op {
        Op::Shutdown => json!({"event": "shutdown"}),
        Op::Stats => {
            let mut v = json!({"event": "stats", "line": n});
            if let (Some(v), serde_json::Value::Object(data)) =
                (v.as_object_mut(), data_plane_stats(&worker.plane))
            {
                v.extend(data);
            }
            v
        }
        Op::Drain => match worker.coord.drain().await {
            Ok(s) => {
                session.unreleased = session
                    .unreleased
                    .saturating_sub(s.finished_recving.len() as u64);
                return (Some(drain_line(&s, n)), s.is_empty());
            }
            Err(e) => json!({"event": "error", "line": n, "error": e.to_string()}),
        },
        Op::Abort { req_id } => {
            let abort = crate::messages::Abort {
                req_id: req_id.as_str().into(),
            };
            match worker.coord.receiver.send(abort).await {
                Ok(r) => json!({"event": "abort", "line": n, "req_id": req_id,
                                "peers_settled": r.peers_settled, "before_dispatch": r.before_dispatch}),
                Err(e) => json!({"event": "error", "line": n, "error": e.to_string()}),
            }
        }
        Op::LoadKv { requests } => {
            let r = worker
                .coord
                .load_metas(metas(requests, &mut session.interner))
                .await;
            if let Ok(r) = &r {
                session.unreleased += r.awaiting as u64;
                // Not printed, so not built either.
                if session.answers == AnswerLevel::Failures && r.rejected.is_empty() {
                    return (None, false);
                }
            }
            load_kv_answer(r, n)
        }
    };
    (Some(v.to_string()), false)
}

/// SIGTERM and SIGINT, as one source.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(StopSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// The next stop signal's name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// What serve keeps from one input line to the next.
struct Session {
    /// Engine ids and bootstrap addresses shared by every request that names them.
    interner: Interner,
    /// Requests awaited (per `load_kv` answers) and not yet handed back released (per `drain`
    /// answers): each awaited request is in exactly one drain's `finished_recving`, at release.
    unreleased: u64,
    /// Which answers are printed.
    answers: AnswerLevel,
    /// Input lines read so far (the number answers cite).
    n: u64,
}

/// Why serve's loop ended.
enum Ended {
    /// End of input, `shutdown`, or a stdin error (reported).
    Input,
    /// SIGTERM or SIGINT: ends as at the end of input, but output the host does not read
    /// within [`SIGNAL_FLUSH_GRACE`] is dropped.
    Signal,
    /// stdout is closed: nothing more reaches the host.
    StdoutLost,
}

async fn serve(args: ServeArgs, mut worker: Worker, ready: serde_json::Value) -> ExitCode {
    let (out, out_queue) = output(args.max_output_backlog_bytes);
    let writer = match Writer::start(out_queue) {
        Ok(w) => w,
        Err(e) => {
            println!(
                "{}",
                json!({"event": "error", "error": format!("stdout writer: {e}")})
            );
            actix_rt::System::current().stop();
            return ExitCode::from(2);
        }
    };
    emit(&out, ready);
    let mut session = Session {
        interner: Interner::default(),
        unreleased: 0,
        answers: args.answers,
        n: 0,
    };
    let mut stop = match StopSignals::new() {
        Ok(stop) => Some(stop),
        Err(e) => {
            emit(
                &out,
                json!({"event": "error", "error": format!("signal handlers: {e}")}),
            );
            None
        }
    };
    let ended = match stop.as_mut() {
        Some(stop) => Some(serve_lines(&args, &mut worker, &mut session, &out, stop).await),
        None => None,
    };
    if ended.is_some() {
        finish(args.events, &mut worker, &mut session, &out).await;
    }
    drop(out);
    let grace = matches!(ended, Some(Ended::Signal)).then_some(SIGNAL_FLUSH_GRACE);
    flush(writer, stop, grace).await;
    actix_rt::System::current().stop();
    match ended {
        Some(Ended::Input | Ended::Signal) => ExitCode::SUCCESS,
        Some(Ended::StdoutLost) => ExitCode::FAILURE,
        None => ExitCode::from(2),
    }
}

/// How long output queued when a stop signal came may take to reach a host that is not
/// reading it: an operator's stop ends serve even then (the rest is dropped, said on stderr).
const SIGNAL_FLUSH_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Wait until everything queued is written to stdout; with `grace` (after a stop signal) no
/// longer than that, and with signal handlers not past another stop signal.
async fn flush(writer: Writer, stop: Option<StopSignals>, grace: Option<std::time::Duration>) {
    let another_signal = async {
        match stop {
            Some(mut stop) => stop.next().await,
            None => std::future::pending().await,
        }
    };
    let grace_over = async {
        match grace {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = writer.join() => {}
        name = another_signal => {
            tracing::warn!(signal = name, "stopping without writing the rest of stdout's backlog");
        }
        () = grace_over => {
            tracing::warn!(grace_s = grace.unwrap_or_default().as_secs(),
                "stdout not written within the grace after the stop signal: stopping without writing the rest of its backlog");
        }
    }
}

/// Read and answer input lines, and print events, until the input ends (or a stop signal, or
/// stdout closed).
async fn serve_lines(
    args: &ServeArgs,
    worker: &mut Worker,
    session: &mut Session,
    out: &Output,
    stop: &mut StopSignals,
) -> Ended {
    let max_line = args.max_line_bytes;
    let mut lines = LineReader::new(BufReader::new(stdin_reader()), max_line);
    let mut paused = false;
    // Made once, not per round of the loop: each registers a waiter when made.
    let stopped = stop.next();
    tokio::pin!(stopped);
    let closed = out.closed();
    tokio::pin!(closed);
    loop {
        if !paused && out.over_high_water() {
            paused = true;
            worker.pauses.increment(1);
            tracing::warn!(
                queued = out.queued(),
                "stdout is not being read: stdin paused until the host reads"
            );
        }
        tokio::select! {
            Some(ev) = next_event(&mut worker.events) => print_events(args.events, ev, worker, out),
            // An operator's stop (SIGTERM, SIGINT): as at the end of input, so the host still
            // gets the last drain and the count of requests abandoned in flight.
            name = &mut stopped => {
                tracing::warn!(signal = name, "stopping: shutting down as at the end of input");
                return Ended::Signal;
            }
            // Nothing serve says can reach the host: stop as at the end of input.
            () = &mut closed => {
                tracing::error!("stdout is closed (a write to it failed): shutting down");
                return Ended::StdoutLost;
            }
            // A host that does not read stdout stops being read: its writes block on the pipe.
            () = out.room(), if paused => {
                paused = false;
                tracing::info!(queued = out.queued(), "stdout drained: reading stdin again");
            }
            line = lines.next_line(), if !paused => {
                let line = match line {
                    Ok(Some(l)) => l,
                    Ok(None) => return Ended::Input,
                    Err(e) => {
                        emit(out, json!({"event": "error", "error": format!("stdin: {e}")}));
                        return Ended::Input;
                    }
                };
                if on_line(line, max_line, worker, session, out).await.is_break() {
                    return Ended::Input;
                }
            }
        }
    }
}

/// The next event, or never with no events kept.
async fn next_event(events: &mut Option<UnboundedReceiver<KvEvent>>) -> Option<KvEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Print `first` and whatever else is queued in this turn, as one chunk of lines: a reply
/// settles a whole batch, and a `select!` round (or a queued line) per event cost more than
/// printing it.
fn print_events(level: EventLevel, first: KvEvent, worker: &mut Worker, out: &Output) {
    let mut chunk = Vec::new();
    let mut next = Some(first);
    while let Some(ev) = next {
        if level.prints(&ev) {
            event_line(&mut chunk, &ev);
        }
        next = worker.events.as_mut().and_then(|rx| rx.try_recv().ok());
    }
    if !chunk.is_empty() {
        chunk.pop(); // the queue adds the last newline
                     // Serialized JSON is UTF-8.
        out.send(String::from_utf8(chunk).unwrap_or_default());
    }
}

/// Answer one input line; `Break` on `shutdown`. A bad line is answered and skipped: only the
/// end of input ends serve.
async fn on_line(
    line: Line,
    max_line: usize,
    worker: &Worker,
    session: &mut Session,
    out: &Output,
) -> std::ops::ControlFlow<()> {
    session.n += 1;
    let n = session.n;
    let line = match line {
        Line::Text(l) => l,
        Line::NotUtf8 { valid_up_to } => {
            emit(
                out,
                json!({"event": "error", "line": n,
                             "error": format!("line is not UTF-8 (invalid byte at offset {valid_up_to})")}),
            );
            return std::ops::ControlFlow::Continue(());
        }
        Line::TooLong { len } => {
            emit(
                out,
                json!({"event": "error", "line": n,
                             "error": format!("line of {len} bytes is longer than --max-line-bytes {max_line}; ignored")}),
            );
            return std::ops::ControlFlow::Continue(());
        }
    };
    if line.trim().is_empty() {
        return std::ops::ControlFlow::Continue(());
    }
    match Op::parse(&line) {
        Err(e) => emit(out, json!({"event": "error", "line": n, "error": e})),
        Ok(Op::Shutdown) => return std::ops::ControlFlow::Break(()),
        Ok(op) => {
            if let (Some(line), _) = answer(op, n, worker, session).await {
                out.send(line);
            }
        }
    }
    std::ops::ControlFlow::Continue(())
}

/// The end: events already produced, a last drain when anything was released since the host's
/// last one, then the `shutdown` line with the count of requests abandoned in flight.
async fn finish(level: EventLevel, worker: &mut Worker, session: &mut Session, out: &Output) {
    // Events already produced are printed before the shutdown line.
    while let Some(ev) = worker.events.as_mut().and_then(|rx| rx.try_recv().ok()) {
        if !level.prints(&ev) {
            continue;
        }
        if let Ok(line) = serde_json::to_string(&ev) {
            out.send(line);
        }
    }
    // What completed since the host's last drain is handed over; what is still in flight (or
    // quarantined) is abandoned, and said so.
    if let (Some(last), false) = answer(Op::Drain, session.n, worker, session).await {
        out.send(last);
    }
    if session.unreleased > 0 {
        tracing::warn!(
            unreleased = session.unreleased,
            "shutting down with requests whose blocks were never released"
        );
    }
    emit(
        out,
        json!({"event": "shutdown", "unreleased": session.unreleased}),
    );
}
