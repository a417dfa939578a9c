//! Languages: how a call's code becomes files, an optional compile step and a run step.
//!
//! One table ([`LanguageSpec`] per language) says, for each language, which toolkit layer its
//! pool composes on the image, which file the code is written to, and the compile and run
//! argv. The built-in table ([`builtin`]) covers the common languages under SandboxFusion's
//! names; `[edge.functions.languages.NAME]` in the config file adds languages or replaces
//! built-in ones. `python` runs in the warm interpreter (forked from the fork-server: no
//! interpreter start); the others run their toolchain from the image and its toolkit
//! (resident in the page cache once the pool is warm); `command` runs any argv in any image.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::worker::RunSpec;
use super::FunctionError;

/// The run argv's first word that means "run the file in the warm Python interpreter".
pub const WARM_PYTHON: &str = "@python";

/// One language of the table (`[edge.functions.languages.NAME]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct LanguageSpec {
    /// Toolkit layer (an image name) composed on the pool's image; imported on first use from
    /// `toolkit_dir/NAME` when the image store does not have it yet.
    pub toolkit: Option<String>,
    /// The language also runs without its toolkit (on the image alone) when the toolkit is
    /// absent (python: the base image has an interpreter; the toolkit adds libraries).
    pub toolkit_optional: bool,
    /// File the code is written to, relative to the scratch dir. `{class}` stands for the
    /// public class named in the code (Java), `Main` when there is none.
    pub file: String,
    /// Compile argv (empty: none); `{class}` and `{file}` are substituted.
    pub compile: Vec<String>,
    /// Run argv (the call's `args` are appended); `["@python", FILE]` runs FILE in the warm
    /// interpreter. `{class}` and `{file}` are substituted.
    pub run: Vec<String>,
    /// Environment of the compile and run steps (under the call's own `env`).
    pub env: BTreeMap<String, String>,
    /// Other names of the language (matched case-insensitively, like the name).
    pub aliases: Vec<String>,
}

/// How to run one call.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The file the code is written to, relative to the scratch dir.
    pub code_file: Option<String>,
    pub compile: Option<Vec<String>>,
    pub run: RunSpec,
    pub env: BTreeMap<String, String>,
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn spec(toolkit: Option<&str>, file: &str, compile: &[&str], run: &[&str]) -> LanguageSpec {
    LanguageSpec {
        toolkit: toolkit.map(str::to_string),
        file: file.into(),
        compile: s(compile),
        run: s(run),
        ..Default::default()
    }
}

/// The built-in table, keyed by lower-case name. Toolkits are the layers
/// `scripts/images/build-function-toolkits.sh` builds.
pub fn builtin() -> BTreeMap<String, LanguageSpec> {
    let go_env: BTreeMap<String, String> = [
        ("GOCACHE", "/tmp/go-build"),
        ("GOPATH", "/tmp/go"),
        ("GO111MODULE", "off"),
        ("CGO_ENABLED", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let mut t = BTreeMap::new();
    let mut add = |name: &str, mut sp: LanguageSpec, aliases: &[&str]| {
        sp.aliases = s(aliases);
        t.insert(name.to_string(), sp);
    };
    add(
        "python",
        LanguageSpec {
            toolkit_optional: true,
            ..spec(Some("fn-python"), "main.py", &[], &[WARM_PYTHON, "main.py"])
        },
        &["python3", "py"],
    );
    add(
        "pytest",
        spec(
            Some("fn-python"),
            "test_main.py",
            &[],
            &[
                "python3",
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "test_main.py",
            ],
        ),
        &[],
    );
    add(
        "bash",
        spec(None, "main.sh", &[], &["bash", "main.sh"]),
        &["sh", "shell"],
    );
    add(
        "c",
        spec(
            None,
            "main.c",
            &[
                "gcc", "-O2", "-pipe", "-std=c11", "-o", "main", "main.c", "-lm",
            ],
            &["./main"],
        ),
        &[],
    );
    add(
        "cpp",
        spec(
            Some("fn-gxx"),
            "main.cpp",
            &[
                "g++",
                "-O2",
                "-pipe",
                "-std=c++17",
                "-o",
                "main",
                "main.cpp",
            ],
            &["./main"],
        ),
        &["c++", "cxx"],
    );
    add(
        "java",
        spec(
            Some("fn-java"),
            "{class}.java",
            &[
                "javac",
                "-J-XX:+UseSerialGC",
                "-J-XX:TieredStopAtLevel=1",
                "-encoding",
                "UTF-8",
                "{file}",
            ],
            &[
                "java",
                "-XX:+UseSerialGC",
                "-XX:TieredStopAtLevel=1",
                "-Xshare:auto",
                "-cp",
                ".",
                "{class}",
            ],
        ),
        &[],
    );
    add(
        "go",
        LanguageSpec {
            env: go_env.clone(),
            ..spec(
                Some("fn-go"),
                "main.go",
                &["go", "build", "-o", "main", "main.go"],
                &["./main"],
            )
        },
        &["golang"],
    );
    add(
        "go_test",
        LanguageSpec {
            env: go_env,
            ..spec(
                Some("fn-go"),
                "main_test.go",
                &[],
                &["go", "test", "-count=1", "main_test.go"],
            )
        },
        &[],
    );
    add(
        "nodejs",
        spec(Some("fn-node"), "main.js", &[], &["node", "main.js"]),
        &["node", "javascript", "js"],
    );
    add(
        "typescript",
        spec(
            Some("fn-node"),
            "main.ts",
            &[
                "tsc", "--target", "es2020", "--module", "commonjs", "--outDir", ".", "main.ts",
            ],
            &["node", "main.js"],
        ),
        &["ts"],
    );
    add(
        "rust",
        spec(
            Some("fn-rust"),
            "main.rs",
            &[
                "rustc",
                "--edition",
                "2021",
                "-C",
                "opt-level=1",
                "-o",
                "main",
                "main.rs",
            ],
            &["./main"],
        ),
        &["rs"],
    );
    add(
        "lua",
        spec(Some("fn-lua"), "main.lua", &[], &["lua", "main.lua"]),
        &[],
    );
    add(
        "php",
        spec(Some("fn-php"), "main.php", &[], &["php", "main.php"]),
        &[],
    );
    add(
        "perl",
        spec(None, "main.pl", &[], &["perl", "main.pl"]),
        &[],
    );
    add(
        "ruby",
        spec(Some("fn-ruby"), "main.rb", &[], &["ruby", "main.rb"]),
        &["rb"],
    );
    add(
        "r",
        spec(Some("fn-r"), "main.R", &[], &["Rscript", "main.R"]),
        &["rscript"],
    );
    t
}

/// Why a language table is not usable.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LanguageTableError {
    #[error("functions.languages.{0}: `run` must name a program")]
    NoRun(String),
    #[error("functions.languages.{0}: `file` must be a plain relative path")]
    BadFile(String),
    #[error("functions.languages.{0}: the name {1:?} is used by two languages")]
    Duplicate(String, String),
    #[error("functions.languages: `command` is reserved (it runs the call's own argv)")]
    Reserved,
}

/// The languages of one edge: the built-in table with the config file's additions.
#[derive(Debug, Clone)]
pub struct Languages {
    table: BTreeMap<String, LanguageSpec>,
    /// Lower-case name or alias → table key.
    names: BTreeMap<String, String>,
}

impl Languages {
    /// The built-in table plus `extra` (an entry of `extra` replaces the built-in one of the
    /// same name, aliases included).
    pub fn new(extra: &BTreeMap<String, LanguageSpec>) -> Result<Self, LanguageTableError> {
        let mut table = builtin();
        for (name, sp) in extra {
            let key = name.to_ascii_lowercase();
            if key == "command" {
                return Err(LanguageTableError::Reserved);
            }
            if sp.run.first().is_none_or(|p| p.is_empty()) {
                return Err(LanguageTableError::NoRun(name.clone()));
            }
            let f = &sp.file;
            if f.is_empty()
                || f.starts_with('/')
                || f.split('/').any(|c| c.is_empty() || c == "." || c == "..")
            {
                return Err(LanguageTableError::BadFile(name.clone()));
            }
            table.insert(key, sp.clone());
        }
        let mut names = BTreeMap::new();
        for (key, sp) in &table {
            for n in std::iter::once(key.clone()).chain(sp.aliases.iter().cloned()) {
                let n = n.to_ascii_lowercase();
                if let Some(other) = names.insert(n.clone(), key.clone()) {
                    if &other != key {
                        return Err(LanguageTableError::Duplicate(key.clone(), n));
                    }
                }
            }
        }
        Ok(Languages { table, names })
    }

    /// The built-in table alone.
    pub fn builtin() -> Self {
        Languages::new(&BTreeMap::new()).expect("the built-in table is valid")
    }

    /// The table key of a language name or alias (`py` → `python`, `C++` → `cpp`); `command`
    /// is its own.
    pub fn canonical(&self, lang: &str) -> Option<&str> {
        let l = lang.to_ascii_lowercase();
        if l == "command" || l == "generic" {
            return Some("command");
        }
        self.names.get(&l).map(String::as_str)
    }

    pub fn get(&self, key: &str) -> Option<&LanguageSpec> {
        self.table.get(key)
    }

    /// Every table entry, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &LanguageSpec)> {
        self.table.iter()
    }
}

/// The public class a Java source declares (`Main` when none is found).
pub fn java_class(code: &str) -> String {
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
        .filter(|w| !w.is_empty())
        .collect();
    for w in words.windows(3) {
        if w[0] == "public" && w[1] == "class" {
            return w[2].to_string();
        }
    }
    for w in words.windows(4) {
        if w[0] == "public" && (w[1] == "final" || w[1] == "abstract") && w[2] == "class" {
            return w[3].to_string();
        }
    }
    "Main".into()
}

/// The plan for a call in the table language `sp` with `code` and program `args`.
pub fn plan_for(sp: &LanguageSpec, code: &str, args: &[String]) -> Plan {
    let class = if sp.file.contains("{class}")
        || sp
            .compile
            .iter()
            .chain(&sp.run)
            .any(|a| a.contains("{class}"))
    {
        java_class(code)
    } else {
        "Main".into()
    };
    let file = sp.file.replace("{class}", &class);
    let sub = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|a| a.replace("{class}", &class).replace("{file}", &file))
            .collect()
    };
    let run = if sp.run.first().map(String::as_str) == Some(WARM_PYTHON) {
        let path = sub(&sp.run[1..]).into_iter().next().unwrap_or(file.clone());
        RunSpec::Python {
            code_path: path,
            args: args.to_vec(),
        }
    } else {
        let mut argv = sub(&sp.run);
        argv.extend(args.iter().cloned());
        RunSpec::Exec { argv }
    };
    Plan {
        code_file: Some(file.clone()),
        compile: (!sp.compile.is_empty()).then(|| sub(&sp.compile)),
        run,
        env: sp.env.clone(),
    }
}

/// The plan of the `command` language: `command` run in the image, `code` written to `main`.
pub fn plan_command(args: &[String], command: &[String]) -> Result<Plan, FunctionError> {
    if command.is_empty() || command[0].is_empty() {
        return Err(FunctionError::BadRequest(
            "language `command` needs `command`, the argv to run (e.g. [\"node\", \"main\"])"
                .into(),
        ));
    }
    let mut argv = command.to_vec();
    argv.extend(args.iter().cloned());
    Ok(Plan {
        code_file: Some("main".into()),
        compile: None,
        run: RunSpec::Exec { argv },
        env: BTreeMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases() {
        let l = Languages::builtin();
        assert_eq!(l.canonical("C++"), Some("cpp"));
        assert_eq!(l.canonical("py"), Some("python"));
        assert_eq!(l.canonical("R"), Some("r"));
        assert_eq!(l.canonical("nodejs"), Some("nodejs"));
        assert_eq!(l.canonical("command"), Some("command"));
        assert_eq!(l.canonical("cobol"), None);
    }

    #[test]
    fn plans() {
        let l = Languages::builtin();
        let p = plan_for(l.get("cpp").unwrap(), "", &["x".into()]);
        assert_eq!(p.code_file.as_deref(), Some("main.cpp"));
        assert!(p.compile.unwrap().contains(&"g++".to_string()));
        assert_eq!(
            p.run,
            RunSpec::Exec {
                argv: vec!["./main".into(), "x".into()]
            }
        );
        let p = plan_for(l.get("python").unwrap(), "print(1)", &[]);
        assert_eq!(
            p.run,
            RunSpec::Python {
                code_path: "main.py".into(),
                args: vec![]
            }
        );
        assert!(plan_command(&[], &[]).is_err());
        let p = plan_command(&[], &["node".into(), "main".into()]).unwrap();
        assert_eq!(
            p.run,
            RunSpec::Exec {
                argv: vec!["node".into(), "main".into()]
            }
        );
    }

    #[test]
    fn java_class_names_the_file() {
        assert_eq!(
            java_class("import x;\npublic final class Solution { }"),
            "Solution"
        );
        assert_eq!(
            java_class("public class Foo{public static void main"),
            "Foo"
        );
        assert_eq!(java_class("class Hidden {}"), "Main");
        let l = Languages::builtin();
        let p = plan_for(l.get("java").unwrap(), "public class Hello {}", &[]);
        assert_eq!(p.code_file.as_deref(), Some("Hello.java"));
        assert!(p.compile.unwrap().contains(&"Hello.java".to_string()));
        assert_eq!(
            p.run,
            RunSpec::Exec {
                argv: s(&[
                    "java",
                    "-XX:+UseSerialGC",
                    "-XX:TieredStopAtLevel=1",
                    "-Xshare:auto",
                    "-cp",
                    ".",
                    "Hello"
                ])
            }
        );
    }

    #[test]
    fn config_extends_the_table() {
        let mut extra = BTreeMap::new();
        extra.insert(
            "Zig".to_string(),
            LanguageSpec {
                toolkit: Some("zig".into()),
                file: "main.zig".into(),
                run: s(&["zig", "run", "main.zig"]),
                aliases: s(&["ziglang"]),
                ..Default::default()
            },
        );
        let l = Languages::new(&extra).unwrap();
        assert_eq!(l.canonical("ziglang"), Some("zig"));
        assert_eq!(l.get("zig").unwrap().toolkit.as_deref(), Some("zig"));
        assert_eq!(l.canonical("python"), Some("python"));
        let bad = |sp: LanguageSpec| {
            let mut m = BTreeMap::new();
            m.insert("x".to_string(), sp);
            Languages::new(&m).unwrap_err()
        };
        assert_eq!(
            bad(LanguageSpec {
                file: "a".into(),
                ..Default::default()
            }),
            LanguageTableError::NoRun("x".into())
        );
        assert_eq!(
            bad(LanguageSpec {
                file: "../a".into(),
                run: s(&["a"]),
                ..Default::default()
            }),
            LanguageTableError::BadFile("x".into())
        );
        assert!(matches!(
            bad(LanguageSpec {
                file: "a".into(),
                run: s(&["a"]),
                aliases: s(&["py"]),
                ..Default::default()
            }),
            LanguageTableError::Duplicate(..)
        ));
    }
}
