//! The `attnres` command line: the arguments ([`args`]), each command's call into the library
//! and what it prints ([`commands`]), and here the process itself: the thread pool, MPI ranks,
//! and the exit status of every error (docs/development.md, "Errors and exit codes").

mod args;
mod commands;
mod output;
mod ranks;

use anyhow::{Context, Result};
use args::{Cli, Command};
use attnres::base::progress::log;
use attnres::train::parallel::Reported;
use clap::Parser;
use output::STDOUT;

#[global_allocator]
static ALLOC: attnres::base::alloc::Recycling = attnres::base::alloc::Recycling;

/// The exit status when stdout is a pipe whose reader has gone (EPIPE): what a shell reports
/// for a Unix tool that SIGPIPE ended (128 + 13). Nothing is printed (docs/development.md,
/// "Errors and exit codes").
const CLOSED_PIPE_EXIT: i32 = 141;

fn main() {
    attnres::base::alloc::keep_small_blocks();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                // --help and --version: a result like any other, so a stdout that is full or
                // gone is an error.
                exit(output::output(&e.render().to_string()));
            }
            // Under mpirun every rank has the same arguments: rank 0 alone says what is wrong
            // (the others stop quietly, as for any error another rank reports).
            if attnres::train::parallel::comm::launched().is_some_and(|(_, rank)| rank != 0) {
                std::process::exit(0);
            }
            log(&format!("error: {}", usage_error(&e)));
            std::process::exit(1);
        }
    };
    exit(run(cli));
}

/// Ends the process with the exit status of `result` (docs/development.md, "Errors and exit
/// codes"), saying what went wrong.
fn exit(result: Result<()>) -> ! {
    if let Err(e) = result {
        if closed_pipe(&e) {
            std::process::exit(CLOSED_PIPE_EXIT);
        }
        // Under mpirun, the rank that failed first prints the error and exits with 1; the
        // others stop quietly with 0: mpirun ends the whole job at the first non-zero exit, which
        // must not come before the error is printed. mpirun's own exit status is then 1.
        if e.downcast_ref::<Reported>().is_some() {
            std::process::exit(0);
        }
        log(&format!("error: {e:#}"));
        std::process::exit(1);
    }
    std::process::exit(0)
}

/// An argument error as one line (docs/development.md, "Errors and exit codes"): clap's first
/// line without its `error: ` prefix, and where to read more.
fn usage_error(e: &clap::Error) -> String {
    if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        return "no command given: one of init, forward, train, eval, generate, serve, bench, \
                compare, report, plan, import, convert, quantize, export (see attnres --help)"
            .into();
    }
    // The message runs to the first blank line or the usage block; a list of missing
    // arguments continues on indented lines.
    let text = e.to_string();
    let message: Vec<&str> = text
        .lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty())
        .take_while(|l| !l.is_empty() && !l.starts_with("Usage:"))
        .collect();
    let message = message.join(" ");
    let message = message.strip_prefix("error: ").unwrap_or(&message);
    format!("{message} (see attnres --help)")
}

/// Whether the error is a write to stdout, a pipe whose reader has closed it.
fn closed_pipe(e: &anyhow::Error) -> bool {
    let broken = |c: &(dyn std::error::Error + 'static)| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    };
    e.chain().any(|c| c.to_string() == STDOUT) && e.chain().any(broken)
}

fn run(cli: Cli) -> Result<()> {
    let ranks = ranks::ranks(&cli.command)?;
    let threads = match (cli.threads, &ranks) {
        (Some(n), _) => {
            let (threads, capped) = attnres::kernels::threads_for(n)?;
            if capped {
                log(&format!(
                    "warning: --threads {n} is more than the {threads} cores here: using {threads}"
                ));
            }
            Some(threads)
        }
        (None, Some(r)) => Some(ranks::default_threads(r)),
        (None, None) => None,
    };
    // The workers' stacks as large as the main thread's, since commands run on one of them.
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(8 << 20);
    if let Some(n) = threads {
        pool = pool.num_threads(n);
    }
    pool.build_global().context("cannot start the thread pool")?;
    match ranks {
        // MPI was initialised on this thread, the only one that may call it ("funneled").
        Some(r) => commands::command(cli.command, Some(&r)),
        // The server runs its model on threads of its own.
        None if matches!(cli.command, Command::Serve(_)) => commands::command(cli.command, None),
        // Everything else on a thread of rayon's pool (`scope` runs its body on one and returns
        // its result). A parallel kernel called from outside the pool hands its work to the pool
        // and sleeps until the work is done, and the pool finds its threads asleep after every
        // stretch of serial code; from a pool thread, the caller does half the work itself and
        // only the other thread has to be woken, so a step makes far fewer context switches
        // (docs/performance.md, "What makes it fast").
        None => rayon::scope(|_| commands::command(cli.command, None)),
    }
}
