//! Plays the simulator from the command line: one seed to replay a
//! failure exactly, or many for a longer search.
//!
//!     cargo run --release -p fencegate-sim --example simulate -- --seed 42 --steps 20000
//!     cargo run --release -p fencegate-sim --example simulate -- --seconds 600
//!     cargo run --release -p fencegate-sim --example simulate -- --mutant barrier-off --seeds 200
//!
//! `--seed S` starts at seed S (default 1); `--seeds K` plays K seeds
//! (default: as many as `--seconds` allows, else 1); `--trace` prints every
//! step of each seed to stderr;
//! `--steps N` is the length of each (default 20,000 events); `--mutant
//! NAME` plants one of the bugs of `fencegate_core::mutant`. It stops at
//! the first violation and prints the command that replays it. The exit
//! status is 1 if a guarantee did not hold.

use std::process::ExitCode;
use std::time::Instant;

use fencegate_core::mutant::{plant, Mutant};
use fencegate_sim::{run, Config};

fn main() -> ExitCode {
    let mut seed = 1u64;
    let mut seeds: Option<u64> = None;
    let mut steps = 20_000u64;
    let mut seconds: Option<u64> = None;
    let mut mutant = None;
    let mut trace = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        let number = |v: String| {
            v.parse::<u64>()
                .unwrap_or_else(|_| usage(&format!("not a number: {v}")))
        };
        match flag.as_str() {
            "--seed" => {
                seed = number(value());
                seeds.get_or_insert(1);
            }
            "--seeds" => seeds = Some(number(value())),
            "--steps" => steps = number(value()),
            "--seconds" => seconds = Some(number(value())),
            "--mutant" => {
                let name = value();
                mutant = Some(Mutant::from_name(&name).unwrap_or_else(|| {
                    let names: Vec<&str> = Mutant::ALL.iter().map(|m| m.name()).collect();
                    usage(&format!("no mutant {name:?}; one of: {}", names.join(", ")))
                }));
            }
            "--trace" => trace = true,
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    plant(mutant);
    let budget = seconds.map(std::time::Duration::from_secs);
    let seeds = seeds.unwrap_or(if budget.is_some() { u64::MAX } else { 1 });
    // The run's time budget and its steps per second, not the simulation's
    // time: the world runs on its own clock and never reads this one.
    #[allow(clippy::disallowed_methods)]
    let started = Instant::now();
    let (mut played, mut total_steps) = (0u64, 0u64);
    for s in seed..seed.saturating_add(seeds) {
        if budget.is_some_and(|b| started.elapsed() >= b) {
            break;
        }
        let report = run(&Config {
            trace,
            ..Config::new(s, steps)
        });
        played += 1;
        total_steps += report.steps;
        if seeds == 1 {
            println!(
                "{} steps, {} ms simulated\n{:#?}",
                report.steps, report.sim_ms, report.stats
            );
        }
        if let Some(v) = report.violation {
            println!("seed {s}: step {} at {} ms: {}", v.step, v.at_ms, v.what);
            let planted = mutant.map_or(String::new(), |m| format!(" --mutant {}", m.name()));
            println!(
                "replay: cargo run --release -p fencegate-sim --example simulate -- --seed {s} \
                 --steps {steps}{planted}"
            );
            return ExitCode::FAILURE;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{played} seeds, {total_steps} steps in {secs:.1} s: {:.0} steps/s, no violation",
        total_steps as f64 / secs.max(1e-9)
    );
    ExitCode::SUCCESS
}

fn usage(why: &str) -> ! {
    if !why.is_empty() {
        eprintln!("simulate: {why}");
    }
    eprintln!(
        "usage: simulate [--seed S] [--seeds K] [--steps N] [--seconds T] [--mutant NAME] \
         [--trace]"
    );
    std::process::exit(2)
}
