//! Languages: how a call's code becomes files, an optional compile step and a run step.
//!
//! `python` runs in the warm interpreter (forked from the fork-server: no interpreter start);
//! `bash`, `c`, `cpp` run their toolchain from the image (resident in the page cache once the
//! pool is warm); `command` runs any argv in any image, so a language is added by an image.

use super::worker::RunSpec;
use super::FunctionError;

/// How to run one language.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The file the code is written to, relative to the scratch dir.
    pub code_file: Option<&'static str>,
    pub compile: Option<Vec<String>>,
    pub run: RunSpec,
}

/// The languages this edge knows, for error messages.
pub const LANGUAGES: &[&str] = &["python", "bash", "c", "cpp", "command"];

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// Canonical name of a language (`py` → `python`, `c++` → `cpp`, ...).
pub fn canonical(lang: &str) -> Result<&'static str, FunctionError> {
    Ok(match lang.to_ascii_lowercase().as_str() {
        "python" | "python3" | "py" => "python",
        "bash" | "sh" | "shell" => "bash",
        "c" => "c",
        "cpp" | "c++" | "cxx" => "cpp",
        "command" | "generic" => "command",
        other => {
            return Err(FunctionError::BadRequest(format!(
                "unknown language {other:?}: use one of {}",
                LANGUAGES.join(", ")
            )))
        }
    })
}

/// The plan for a call in `lang` (canonical) with program `args` (and `command` for `command`).
pub fn plan(lang: &str, args: &[String], command: &[String]) -> Result<Plan, FunctionError> {
    let with_args = |mut v: Vec<String>| {
        v.extend(args.iter().cloned());
        v
    };
    Ok(match lang {
        "python" => Plan {
            code_file: Some("main.py"),
            compile: None,
            run: RunSpec::Python {
                code_path: "main.py".into(),
                args: args.to_vec(),
            },
        },
        "bash" => Plan {
            code_file: Some("main.sh"),
            compile: None,
            run: RunSpec::Exec {
                argv: with_args(s(&["bash", "main.sh"])),
            },
        },
        "c" => Plan {
            code_file: Some("main.c"),
            compile: Some(s(&[
                "gcc", "-O2", "-pipe", "-std=c11", "-o", "main", "main.c", "-lm",
            ])),
            run: RunSpec::Exec {
                argv: with_args(s(&["./main"])),
            },
        },
        "cpp" => Plan {
            code_file: Some("main.cpp"),
            compile: Some(s(&[
                "g++",
                "-O2",
                "-pipe",
                "-std=c++17",
                "-o",
                "main",
                "main.cpp",
            ])),
            run: RunSpec::Exec {
                argv: with_args(s(&["./main"])),
            },
        },
        "command" => {
            if command.is_empty() || command[0].is_empty() {
                return Err(FunctionError::BadRequest(
                    "language `command` needs `command`, the argv to run (e.g. [\"node\", \"main\"])"
                        .into(),
                ));
            }
            Plan {
                code_file: Some("main"),
                compile: None,
                run: RunSpec::Exec {
                    argv: with_args(command.to_vec()),
                },
            }
        }
        other => {
            return Err(FunctionError::BadRequest(format!(
                "unknown language {other:?}"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases() {
        assert_eq!(canonical("C++").unwrap(), "cpp");
        assert_eq!(canonical("py").unwrap(), "python");
        assert!(canonical("cobol").is_err());
    }

    #[test]
    fn plans() {
        let p = plan("cpp", &["x".into()], &[]).unwrap();
        assert_eq!(p.code_file, Some("main.cpp"));
        assert!(p.compile.unwrap().contains(&"g++".to_string()));
        assert_eq!(
            p.run,
            RunSpec::Exec {
                argv: vec!["./main".into(), "x".into()]
            }
        );
        assert!(plan("command", &[], &[]).is_err());
        let p = plan("command", &[], &["node".into(), "main".into()]).unwrap();
        assert_eq!(
            p.run,
            RunSpec::Exec {
                argv: vec!["node".into(), "main".into()]
            }
        );
    }
}
