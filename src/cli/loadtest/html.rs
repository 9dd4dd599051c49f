//! The load test's report as one self-contained HTML page: inline CSS and
//! SVG, no script, nothing fetched. Per lease a timeline of its terms (who
//! held it, when, with which token) with every write as a mark coloured by
//! its outcome, and any stale write the storage applied drawn large and
//! red; latency percentiles and rejections over time; the summary and the
//! verdict. Lease ids never reach it: the run keeps none past its writes.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;

use super::check::{ClientWrite, Outcome};
use super::{summary, Report, TermSpan};

/// Width of the plotting area, in SVG units.
const WIDTH: f64 = 1000.0;
/// Left margin for lane labels.
const LEFT: f64 = 90.0;
/// Height of one lease's lane.
const LANE: f64 = 54.0;
/// Writes drawn at most (one in N of a longer run, evenly), besides the
/// stale writes that landed, which are always drawn: a long run's page
/// stays a few megabytes.
const MAX_MARKS: usize = 20_000;

/// The page for `report`, from the run's `writes` and `terms`.
pub fn render(report: &Report, writes: &[ClientWrite], terms: &[TermSpan]) -> String {
    let duration_ms = report.duration_ms.max(1) as f64;
    let x = |ms: f64| LEFT + (ms / duration_ms).clamp(0.0, 1.0) * WIDTH;
    let landed: HashSet<&str> = report
        .findings
        .stale_applied_ids
        .iter()
        .map(String::as_str)
        .collect();
    let class = if report.findings.violations() > 0 {
        "unsafe"
    } else if report.verdict.starts_with("SAFE") {
        "safe"
    } else {
        "inconclusive"
    };
    let via = match &report.direct {
        Some(d) => format!("straight to {d}: no fencing"),
        None => format!("through fencegate at {}", report.target),
    };
    let mut page = String::with_capacity(64 * 1024 + writes.len().min(MAX_MARKS) * 160);
    let _ = write!(
        page,
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fencegate loadtest {run}: {verdict}</title>
<style>{STYLE}</style></head>
<body>
<header class="verdict {class}"><div class="big" id="verdict">{verdict}</div>
<div>run {run} · writes {via} to {path} · checked by {checkers} · {writers} writers, {leases} leases, TTL {ttl} ms, pauses p={pp} of {pause} ms, skew {skew} ms, seed {seed}</div></header>
<main>
"#,
        run = esc(&report.run_id),
        verdict = esc(&report.verdict),
        via = esc(&via),
        path = esc(&report.path),
        checkers = esc(&super::checkers(report)),
        writers = report.writers,
        leases = report.leases,
        ttl = report.ttl_ms,
        pp = report.pause_prob,
        pause = report.pause_ms,
        skew = report.skew_ms,
        seed = report.seed,
    );
    figures(&mut page, report, landed.len());
    timeline(&mut page, writes, terms, &landed, duration_ms, &x);
    latency(&mut page, writes, duration_ms, &x);
    rejections(&mut page, writes, duration_ms, &x);
    let _ = write!(
        page,
        "<section><h2>Summary</h2><pre id=\"summary\">{}</pre></section>\n</main></body></html>\n",
        esc(&summary(report))
    );
    page
}

/// The headline figures, as cards.
fn figures(page: &mut String, report: &Report, landed: usize) {
    let f = &report.findings;
    let cards = [
        ("writes attempted", f.writes_attempted.to_string(), ""),
        ("acknowledged", f.acknowledged.to_string(), ""),
        ("rejected", f.rejected.to_string(), ""),
        (
            "stale attempts rejected",
            format!("{} of {}", f.stale_attempts_rejected, f.stale_attempts),
            "",
        ),
        (
            "stale writes applied",
            landed.to_string(),
            if landed > 0 { "bad" } else { "good" },
        ),
        (
            "p99 latency",
            format!(
                "{:.2} ms",
                report.latency_us.get("p99").copied().unwrap_or(0) as f64 / 1000.0
            ),
            "",
        ),
    ];
    page.push_str("<section class=\"cards\">");
    for (k, v, class) in cards {
        let _ = write!(
            page,
            "<div class=\"card {class}\"><div class=\"k\">{k}</div><div class=\"v\">{}</div></div>",
            esc(&v)
        );
    }
    page.push_str("</section>\n");
}

/// What a write's mark looks like: its class and colour.
fn mark(w: &ClientWrite, landed: bool) -> (&'static str, &'static str) {
    if landed {
        return ("stale-landed", "#e53e3e");
    }
    match &w.outcome {
        Outcome::Acknowledged => ("w-ok", "#38a169"),
        Outcome::Rejected(reason) => match reason.as_str() {
            "stale-fencing-token" => ("w-rejected w-stale-fencing-token", "#dd6b20"),
            "lease-expired" => ("w-rejected w-lease-expired", "#d69e2e"),
            _ => ("w-rejected w-other", "#805ad5"),
        },
        Outcome::Unknown(_) => ("w-unknown", "#718096"),
        Outcome::Failed(_) => ("w-failed", "#1a202c"),
    }
}

/// One lane per lease: its terms as bars, its writes as marks below them.
fn timeline(
    page: &mut String,
    writes: &[ClientWrite],
    terms: &[TermSpan],
    landed: &HashSet<&str>,
    duration_ms: f64,
    x: &dyn Fn(f64) -> f64,
) {
    let mut lanes: BTreeMap<&str, (Vec<&TermSpan>, Vec<&ClientWrite>)> = BTreeMap::new();
    for t in terms {
        lanes.entry(&t.lease).or_default().0.push(t);
    }
    for w in writes {
        lanes.entry(&w.lease).or_default().1.push(w);
    }
    let sampled = writes
        .iter()
        .filter(|w| !landed.contains(w.write_id.as_str()))
        .count();
    let every = sampled.div_ceil(MAX_MARKS).max(1);
    // Each writer its own colour, spread around the wheel by the golden
    // angle so neighbours differ.
    let writers: std::collections::BTreeSet<&str> =
        terms.iter().map(|t| t.writer.as_str()).collect();
    let hues: std::collections::HashMap<&str, usize> = writers
        .into_iter()
        .enumerate()
        .map(|(i, w)| (w, (i * 137 + 150) % 360))
        .collect();
    let height = lanes.len() as f64 * LANE + 30.0;
    let _ = write!(
        page,
        "<section><h2>Terms and writes, per lease</h2>\
         <p class=\"legend\"><span class=\"sw\" style=\"background:#cbd5e0\"></span>a term (token, holder) \
         <span class=\"dot\" style=\"background:#38a169\"></span>applied \
         <span class=\"dot\" style=\"background:#dd6b20\"></span>rejected: stale-fencing-token \
         <span class=\"dot\" style=\"background:#d69e2e\"></span>rejected: lease-expired \
         <span class=\"dot\" style=\"background:#805ad5\"></span>rejected: other \
         <span class=\"dot\" style=\"background:#718096\"></span>outcome unknown \
         <span class=\"ring\"></span>stale attempt \
         <span class=\"dot big\" style=\"background:#e53e3e\"></span><b>stale write that landed</b></p>"
    );
    if every > 1 {
        let _ = write!(
            page,
            "<p class=\"note\">One write in {every} is drawn ({sampled} in all), and every stale write that landed.</p>"
        );
    }
    let _ = write!(
        page,
        "<svg class=\"timeline\" viewBox=\"0 0 {w} {height}\" width=\"100%\" role=\"img\" aria-label=\"terms and writes over time\">",
        w = LEFT + WIDTH + 10.0
    );
    axis(page, duration_ms, height - 18.0, x);
    for (i, (lease, (terms, writes))) in lanes.iter().enumerate() {
        let top = i as f64 * LANE;
        let _ = write!(
            page,
            "<g class=\"lane\" data-lease=\"{l}\"><text x=\"4\" y=\"{ty}\" class=\"lane-name\">{l}</text>\
             <line x1=\"{LEFT}\" x2=\"{x2}\" y1=\"{ly}\" y2=\"{ly}\" class=\"grid\"/>",
            l = esc(lease),
            ty = top + 22.0,
            x2 = LEFT + WIDTH,
            ly = top + LANE - 2.0,
        );
        for t in terms {
            let hue = hues.get(t.writer.as_str()).copied().unwrap_or(0);
            term_bar(page, t, top, hue, x);
        }
        let mut seen = 0usize;
        for w in writes {
            let is_landed = landed.contains(w.write_id.as_str());
            if !is_landed {
                seen += 1;
                if !seen.is_multiple_of(every) {
                    continue;
                }
            }
            write_mark(page, w, is_landed, top, x);
        }
        page.push_str("</g>");
    }
    page.push_str("</svg></section>\n");
}

/// A term as a bar in its lease's lane (at `top`), in its writer's `hue`.
fn term_bar(page: &mut String, t: &TermSpan, top: f64, hue: usize, x: &dyn Fn(f64) -> f64) {
    let (x1, x2) = (x(t.from_ms as f64), x(t.until_ms as f64));
    let _ = write!(
        page,
        "<g class=\"term\"><title>token {tok}, held by {who} from {a} ms to {b} ms</title>\
         <rect x=\"{x1:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"18\" rx=\"3\" fill=\"hsl({hue},55%,80%)\" stroke=\"hsl({hue},45%,45%)\"/>",
        tok = t.token,
        who = esc(&t.writer),
        a = t.from_ms,
        b = t.until_ms,
        y = top + 6.0,
        w = (x2 - x1).max(1.0),
    );
    if x2 - x1 > 28.0 {
        let _ = write!(
            page,
            "<text x=\"{tx:.1}\" y=\"{y:.1}\" class=\"term-label\">{tok}</text>",
            tx = x1 + 3.0,
            y = top + 19.0,
            tok = t.token
        );
    }
    page.push_str("</g>");
}

/// A write as a mark in its lease's lane (at `top`): a stale write that
/// landed as a line through the lane.
fn write_mark(
    page: &mut String,
    w: &ClientWrite,
    is_landed: bool,
    top: f64,
    x: &dyn Fn(f64) -> f64,
) {
    let (class, colour) = mark(w, is_landed);
    let cx = x(w.at_us as f64 / 1000.0);
    let cy = top + 36.0;
    let what = match &w.outcome {
        Outcome::Acknowledged if is_landed => "APPLIED STALE".to_owned(),
        Outcome::Acknowledged => "acknowledged".to_owned(),
        Outcome::Rejected(r) => format!("rejected: {r}"),
        Outcome::Unknown(r) => format!("outcome unknown: {r}"),
        Outcome::Failed(e) => format!("failed: {e}"),
    };
    let title = format!(
        "{} by {} with token {}{}: {what}",
        w.write_id,
        w.writer,
        w.token,
        if w.stale { " (stale attempt)" } else { "" }
    );
    if is_landed {
        let _ = write!(
            page,
            "<g class=\"{class}\"><title>{t}</title><line x1=\"{cx:.1}\" x2=\"{cx:.1}\" y1=\"{y1:.1}\" y2=\"{y2:.1}\" stroke=\"{colour}\" stroke-width=\"2\"/>\
             <circle cx=\"{cx:.1}\" cy=\"{cy:.1}\" r=\"7\" fill=\"{colour}\" stroke=\"#742a2a\" stroke-width=\"1.5\"/></g>",
            t = esc(&title),
            y1 = top + 2.0,
            y2 = top + LANE - 4.0,
        );
    } else {
        let stroke = if w.stale {
            " stroke=\"#1a202c\" stroke-width=\"1.5\""
        } else {
            ""
        };
        let _ = write!(
            page,
            "<circle class=\"{class}{s}\" cx=\"{cx:.1}\" cy=\"{cy:.1}\" r=\"{r}\" fill=\"{colour}\"{stroke}><title>{t}</title></circle>",
            s = if w.stale { " w-stale" } else { "" },
            r = if w.stale { 4.5 } else { 3.0 },
            t = esc(&title),
        );
    }
}

/// Time ticks along the bottom of a chart at `y`.
fn axis(page: &mut String, duration_ms: f64, y: f64, x: &dyn Fn(f64) -> f64) {
    let step = nice_step(duration_ms / 8.0);
    let mut t = 0.0;
    while t <= duration_ms {
        let _ = write!(
            page,
            "<text x=\"{:.1}\" y=\"{:.1}\" class=\"tick\">{}</text>",
            x(t),
            y + 14.0,
            if step >= 1000.0 {
                format!("{:.0} s", t / 1000.0)
            } else {
                format!("{t:.0} ms")
            }
        );
        t += step;
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let raw = raw.max(1.0);
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * power)
}

/// Number of time buckets of the charts over time.
const BUCKETS: usize = 60;

fn bucket_of(at_ms: f64, duration_ms: f64) -> usize {
    ((at_ms / duration_ms * BUCKETS as f64) as usize).min(BUCKETS - 1)
}

/// A time bucket's middle (ms since the start), p50 and p99 (ms), if any
/// write was sent in it.
type Point = (f64, Option<f64>, Option<f64>);

/// p50 and p99 of the writes' latencies per time bucket, as two lines.
fn latency(page: &mut String, writes: &[ClientWrite], duration_ms: f64, x: &dyn Fn(f64) -> f64) {
    let mut buckets: Vec<Vec<u64>> = vec![Vec::new(); BUCKETS];
    for w in writes {
        buckets[bucket_of(w.at_us as f64 / 1000.0, duration_ms)].push(w.latency_us);
    }
    let quantile = |v: &mut Vec<u64>, q: f64| -> Option<f64> {
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        Some(v[i] as f64 / 1000.0)
    };
    let points: Vec<Point> = buckets
        .iter_mut()
        .enumerate()
        .map(|(i, v)| {
            let mid = (i as f64 + 0.5) * duration_ms / BUCKETS as f64;
            (mid, quantile(v, 0.5), quantile(v, 0.99))
        })
        .collect();
    let top = points
        .iter()
        .filter_map(|p| p.2)
        .fold(0.0f64, f64::max)
        .max(0.001);
    let h = 160.0;
    let y = |ms: f64| 10.0 + h - (ms / top) * h;
    let line = |pick: &dyn Fn(&Point) -> Option<f64>| -> String {
        points
            .iter()
            .filter_map(|p| pick(p).map(|v| format!("{:.1},{:.1}", x(p.0), y(v))))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let _ = write!(
        page,
        "<section><h2>Write latency over time</h2>\
         <p class=\"legend\"><span class=\"sw\" style=\"background:#3182ce\"></span>p50 \
         <span class=\"sw\" style=\"background:#e53e3e\"></span>p99 (each point: {per:.0} ms of the run)</p>\
         <svg class=\"chart\" id=\"latency\" viewBox=\"0 0 {w} {hh}\" width=\"100%\" role=\"img\" aria-label=\"latency over time\">\
         <text x=\"4\" y=\"18\" class=\"tick\">{top:.1} ms</text><text x=\"4\" y=\"{by:.1}\" class=\"tick\">0</text>\
         <line x1=\"{LEFT}\" x2=\"{x2}\" y1=\"{by:.1}\" y2=\"{by:.1}\" class=\"grid\"/>\
         <polyline class=\"p50\" fill=\"none\" stroke=\"#3182ce\" stroke-width=\"2\" points=\"{p50}\"/>\
         <polyline class=\"p99\" fill=\"none\" stroke=\"#e53e3e\" stroke-width=\"2\" points=\"{p99}\"/>",
        per = duration_ms / BUCKETS as f64,
        w = LEFT + WIDTH + 10.0,
        hh = h + 40.0,
        by = y(0.0),
        x2 = LEFT + WIDTH,
        p50 = line(&|p| p.1),
        p99 = line(&|p| p.2),
    );
    axis(page, duration_ms, h + 12.0, x);
    page.push_str("</svg></section>\n");
}

/// Rejected writes per second, per time bucket, as bars.
fn rejections(page: &mut String, writes: &[ClientWrite], duration_ms: f64, x: &dyn Fn(f64) -> f64) {
    let mut counts = [0u64; BUCKETS];
    for w in writes {
        if matches!(w.outcome, Outcome::Rejected(_)) {
            counts[bucket_of(w.at_us as f64 / 1000.0, duration_ms)] += 1;
        }
    }
    let bucket_s = duration_ms / BUCKETS as f64 / 1000.0;
    let rates: Vec<f64> = counts.iter().map(|c| *c as f64 / bucket_s).collect();
    let top = rates.iter().copied().fold(0.0f64, f64::max).max(1.0);
    let h = 120.0;
    let _ = write!(
        page,
        "<section><h2>Rejected writes per second</h2>\
         <svg class=\"chart\" id=\"rejections\" viewBox=\"0 0 {w} {hh}\" width=\"100%\" role=\"img\" aria-label=\"rejections per second\">\
         <text x=\"4\" y=\"18\" class=\"tick\">{top:.0}/s</text><text x=\"4\" y=\"{by:.1}\" class=\"tick\">0</text>",
        w = LEFT + WIDTH + 10.0,
        hh = h + 40.0,
        by = 10.0 + h,
    );
    let bar_w = WIDTH / BUCKETS as f64;
    for (i, rate) in rates.iter().enumerate() {
        let bh = rate / top * h;
        let _ = write!(
            page,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"#dd6b20\"><title>{rate:.0}/s</title></rect>",
            x(i as f64 * duration_ms / BUCKETS as f64),
            10.0 + h - bh,
            (bar_w - 1.0).max(0.5),
        );
    }
    axis(page, duration_ms, h + 12.0, x);
    page.push_str("</svg></section>\n");
}

/// Text made safe for HTML content and attribute values.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "\
*{box-sizing:border-box}body{margin:0;font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;background:#f6f7f9;color:#1d2330}\
header.verdict{padding:16px 24px;color:#fff}header.safe{background:#276749}header.unsafe{background:#c53030}header.inconclusive{background:#975a16}\
header .big{font-size:24px;font-weight:700}main{padding:16px 24px}h2{font-size:16px;margin:20px 0 6px}\
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(160px,1fr));gap:12px}\
.card{background:#fff;border:1px solid #e3e6eb;border-radius:8px;padding:10px 14px}.card .k{color:#6b7280;font-size:12px;text-transform:uppercase}\
.card .v{font-size:22px;font-weight:600}.card.bad{border-color:#e53e3e;background:#fff5f5}.card.bad .v{color:#c53030}.card.good .v{color:#276749}\
svg{background:#fff;border:1px solid #e3e6eb;border-radius:8px}.lane-name{font:12px monospace;fill:#1d2330}.term-label{font:10px monospace;fill:#1a202c}\
.tick{font:11px sans-serif;fill:#6b7280}.grid{stroke:#edf2f7}.legend{font-size:12px;color:#4a5568}.note{font-size:12px;color:#6b7280}\
.sw{display:inline-block;width:14px;height:8px;margin:0 4px 0 10px;border-radius:2px}\
.dot{display:inline-block;width:9px;height:9px;border-radius:50%;margin:0 4px 0 10px}.dot.big{width:13px;height:13px}\
.ring{display:inline-block;width:10px;height:10px;border-radius:50%;border:2px solid #1a202c;margin:0 4px 0 10px}\
pre{background:#fff;border:1px solid #e3e6eb;border-radius:8px;padding:12px;overflow:auto}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_round() {
        assert_eq!(nice_step(130.0), 200.0);
        assert_eq!(nice_step(1000.0), 1000.0);
        assert_eq!(nice_step(3100.0), 5000.0);
        assert_eq!(nice_step(0.2), 1.0);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }
}
