//! Statuses of runs and verdicts of test cases (pure logic).

use dsec_wire::api::{CompareMode, FunctionStatus, Verdict};

use super::worker::{MemoryReport, StepResult};

/// The status of one step. `oom` says the memory cgroup OOM-killed something during the call.
pub fn status_of(r: &StepResult, oom: bool, compile: bool) -> FunctionStatus {
    const SIGKILL: i32 = 9;
    if r.timed_out || r.cpu_exceeded {
        return if compile {
            FunctionStatus::CompileError
        } else {
            FunctionStatus::Timeout
        };
    }
    if r.output_exceeded && !compile {
        return FunctionStatus::OutputExceeded;
    }
    if r.signal == Some(SIGKILL) && oom {
        return if compile {
            FunctionStatus::CompileError
        } else {
            FunctionStatus::MemoryExceeded
        };
    }
    if r.exit != 0 || r.signal.is_some() {
        return if compile {
            FunctionStatus::CompileError
        } else {
            FunctionStatus::RuntimeError
        };
    }
    FunctionStatus::Ok
}

/// Whether `got` matches `expected` under `mode`.
pub fn matches(got: &str, expected: &str, mode: CompareMode) -> bool {
    match mode {
        CompareMode::Exact => got == expected,
        CompareMode::Whitespace => got.split_whitespace().eq(expected.split_whitespace()),
    }
}

/// The verdict of a run with `status` whose output was `got`.
pub fn verdict(status: FunctionStatus, got: &str, expected: &str, mode: CompareMode) -> Verdict {
    match status {
        FunctionStatus::Ok if matches(got, expected, mode) => Verdict::Accepted,
        FunctionStatus::Ok => Verdict::WrongAnswer,
        FunctionStatus::Timeout => Verdict::TimeLimitExceeded,
        FunctionStatus::MemoryExceeded => Verdict::MemoryLimitExceeded,
        FunctionStatus::OutputExceeded => Verdict::OutputLimitExceeded,
        FunctionStatus::RuntimeError => Verdict::RuntimeError,
        FunctionStatus::CompileError => Verdict::CompileError,
        FunctionStatus::SandboxError => Verdict::SandboxError,
    }
}

/// The overall verdict: accepted iff every case is, else the first other one.
pub fn overall(verdicts: impl IntoIterator<Item = Verdict>) -> Verdict {
    verdicts
        .into_iter()
        .find(|v| *v != Verdict::Accepted)
        .unwrap_or(Verdict::Accepted)
}

/// True when a memory report says the limit was hit.
pub fn hit_memory_limit(m: &MemoryReport) -> bool {
    m.oom_kills > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(exit: i32, signal: Option<i32>) -> StepResult {
        StepResult {
            exit,
            signal,
            ..Default::default()
        }
    }

    #[test]
    fn statuses() {
        assert_eq!(status_of(&run(0, None), false, false), FunctionStatus::Ok);
        assert_eq!(
            status_of(&run(1, None), false, false),
            FunctionStatus::RuntimeError
        );
        assert_eq!(
            status_of(&run(137, Some(9)), true, false),
            FunctionStatus::MemoryExceeded
        );
        assert_eq!(
            status_of(&run(137, Some(9)), false, false),
            FunctionStatus::RuntimeError
        );
        assert_eq!(
            status_of(&run(1, None), false, true),
            FunctionStatus::CompileError
        );
        let mut t = run(137, Some(9));
        t.timed_out = true;
        assert_eq!(status_of(&t, true, false), FunctionStatus::Timeout);
        let mut o = run(153, Some(25));
        o.output_exceeded = true;
        assert_eq!(status_of(&o, false, false), FunctionStatus::OutputExceeded);
    }

    #[test]
    fn comparisons() {
        assert!(matches("1 2\n3\n", "1 2 3", CompareMode::Whitespace));
        assert!(!matches("1 2\n3\n", "1 2 3", CompareMode::Exact));
        assert!(matches("x\n", "x\n", CompareMode::Exact));
        assert!(!matches("12", "1 2", CompareMode::Whitespace));
        assert_eq!(
            verdict(FunctionStatus::Ok, "4\n", "5", CompareMode::Whitespace),
            Verdict::WrongAnswer
        );
        assert_eq!(
            verdict(FunctionStatus::Timeout, "", "5", CompareMode::Whitespace),
            Verdict::TimeLimitExceeded
        );
        assert_eq!(
            overall([
                Verdict::Accepted,
                Verdict::WrongAnswer,
                Verdict::RuntimeError
            ]),
            Verdict::WrongAnswer
        );
        assert_eq!(overall([Verdict::Accepted]), Verdict::Accepted);
    }
}
