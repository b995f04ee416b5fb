//! Progress bars of long operations: drawn on stderr when both stdout and
//! stderr are terminals, hidden otherwise, so that scripts and logs see only
//! the result lines.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Whether bars are drawn: a person is watching (not a pipe, file or script).
pub fn on_terminal() -> bool {
    std::io::stdout().is_terminal() && std::io::stderr().is_terminal()
}

/// A bar over `total` bytes, with `what` before it.
pub fn bytes(total: u64, what: &str) -> ProgressBar {
    if !on_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            // (wide_msg: the message is cut to the terminal's width, never wrapped.)
            "stfs: {wide_msg} [{bar:24}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// A spinner for a step whose length is not known, with `what` beside it.
pub fn spinner(what: &str) -> ProgressBar {
    if !on_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("stfs: {spinner} {wide_msg} {elapsed}")
            .expect("a valid template"),
    );
    bar.set_message(what.to_string());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// Clears a bar or spinner and stops its ticking thread (joined, so that the
/// caller may fork afterwards).
pub fn clear(bar: ProgressBar) {
    bar.disable_steady_tick();
    bar.finish_and_clear();
}
