//! Reading a module's source for the paths of its crate it names: comments and literals
//! blanked, tokens, `use` trees expanded, `crate::`/`super::`/`self::` paths made absolute from
//! the crate root (in a `use`, a path may also start with a child module).

use std::collections::BTreeSet;

use super::join;

/// One path named by a module: absolute segments from the crate root, and whether it is a
/// `pub use` (a re-export) with the name it exports.
pub(crate) struct Named {
    pub(crate) from: String,
    pub(crate) path: Vec<String>,
    pub(crate) reexport: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    PathSep,
    Open,
    Close,
    Comma,
    Star,
    Other(char),
}

/// Every path of this crate that `text` (the source of `module`) names.
pub(crate) fn names_in(module: &str, text: &str, modules: &BTreeSet<String>) -> Vec<Named> {
    let tokens = tokenize(&strip_comments_and_literals(text));
    let mut named = Vec::new();
    let mut inline: Vec<(String, usize)> = Vec::new(); // inline `mod x {` and its brace depth
    let mut depth = 0;
    let mut i = 0;
    while i < tokens.len() {
        let here = (inline.last()).map_or(module.to_string(), |(m, _)| m.clone());
        let ident = |k: usize| match tokens.get(k) {
            Some(Token::Ident(s)) => Some(s.as_str()),
            _ => None,
        };
        match &tokens[i] {
            Token::Open => depth += 1,
            Token::Close => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Token::Ident(word) if word == "mod" && tokens.get(i + 2) == Some(&Token::Open) => {
                inline.push((join(&here, ident(i + 1).unwrap_or("")), depth));
            }
            Token::Ident(word) if word == "use" => {
                let public =
                    i > 0 && (ident(i - 1) == Some("pub") || tokens.get(i - 1) == Some(&Token::Other(')')));
                let mut trees = Vec::new();
                i = parse_use_tree(&tokens, i + 1, Vec::new(), &mut trees);
                for (segments, alias) in trees {
                    let exported = alias.or_else(|| exported_name(&segments)).filter(|_| public);
                    if let Some(path) = absolute(&here, &segments, modules, true) {
                        named.push(Named {
                            from: module.to_string(),
                            path,
                            reexport: exported,
                        });
                    }
                }
                continue;
            }
            Token::Ident(word)
                if matches!(word.as_str(), "crate" | "super" | "self")
                    && tokens.get(i + 1) == Some(&Token::PathSep)
                    && (i == 0 || tokens[i - 1] != Token::Other('$')) =>
            {
                let mut segments = vec![word.clone()];
                let mut k = i + 1;
                while tokens.get(k) == Some(&Token::PathSep)
                    && let Some(next) = ident(k + 1)
                {
                    segments.push(next.to_string());
                    k += 2;
                }
                if let Some(path) = absolute(&here, &segments, modules, false) {
                    named.push(Named {
                        from: module.to_string(),
                        path,
                        reexport: None,
                    });
                }
                i = k;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    named
}

/// The name a `pub use` of `segments` exports (none for a glob).
fn exported_name(segments: &[String]) -> Option<String> {
    match segments.last()?.as_str() {
        "*" => None,
        "self" => segments.iter().rev().nth(1).cloned(),
        name => Some(name.to_string()),
    }
}

/// `segments` from the crate root, seen from module `here`; `None` for another crate's path. In
/// a `use`, a path may start with a child module of `here`.
fn absolute(
    here: &str,
    segments: &[String],
    modules: &BTreeSet<String>,
    in_use: bool,
) -> Option<Vec<String>> {
    let mut base: Vec<String> = here
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let mut rest = segments;
    match segments.first()?.as_str() {
        "crate" => {
            base.clear();
            rest = &segments[1..];
        }
        "self" => rest = &segments[1..],
        "super" => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        child if in_use && modules.contains(&join(here, child)) => {}
        _ => return None,
    }
    base.extend(rest.iter().filter(|s| *s != "self" && *s != "*").cloned());
    Some(base)
}

/// Parses one use tree from `i`; pushes every path it names (with its alias) onto `out`.
fn parse_use_tree(
    tokens: &[Token],
    mut i: usize,
    mut segments: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    loop {
        match tokens.get(i) {
            Some(Token::Ident(s)) => segments.push(s.clone()),
            Some(Token::Star) => segments.push("*".into()),
            Some(Token::Open) => {
                i += 1;
                while tokens.get(i).is_some_and(|t| *t != Token::Close) {
                    i = parse_use_tree(tokens, i, segments.clone(), out);
                    if tokens.get(i) == Some(&Token::Comma) {
                        i += 1;
                    }
                }
                return i + 1;
            }
            _ => break,
        }
        i += 1;
        if tokens.get(i) != Some(&Token::PathSep) {
            break;
        }
        i += 1;
    }
    let mut alias = None;
    if tokens.get(i) == Some(&Token::Ident("as".into())) {
        if let Some(Token::Ident(name)) = tokens.get(i + 1) {
            alias = Some(name.clone());
        }
        i += 2;
    }
    out.push((segments, alias));
    i
}

fn tokenize(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let word_end = |from: usize| {
            (from..chars.len())
                .find(|&k| !(chars[k].is_alphanumeric() || chars[k] == '_'))
                .unwrap_or(chars.len())
        };
        if c.is_alphabetic() || c == '_' {
            let end = word_end(i);
            tokens.push(Token::Ident(chars[i..end].iter().collect()));
            i = end;
            continue;
        }
        if c.is_ascii_digit() {
            i = word_end(i);
            tokens.push(Token::Other('0'));
            continue;
        }
        match c {
            ':' if chars.get(i + 1) == Some(&':') => {
                tokens.push(Token::PathSep);
                i += 1;
            }
            '{' => tokens.push(Token::Open),
            '}' => tokens.push(Token::Close),
            ',' => tokens.push(Token::Comma),
            '*' => tokens.push(Token::Star),
            c if c.is_whitespace() => {}
            c => tokens.push(Token::Other(c)),
        }
        i += 1;
    }
    tokens
}

/// `text` with comments, string and character literals blanked out (lifetimes kept).
fn strip_comments_and_literals(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    while i < c.len() {
        let after_word = i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_');
        if at(i) == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if at(i) == '/' && at(i + 1) == '*' {
            let mut nested = 0;
            while i < c.len() {
                if at(i) == '/' && at(i + 1) == '*' {
                    nested += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    nested -= 1;
                    i += 2;
                    if nested == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if let Some((body, hashes)) = raw_string_at(&c, i).filter(|_| !after_word) {
            let closes = |k: usize| c[k] == '"' && (1..=hashes).all(|h| at(k + h) == '#');
            i = (body..c.len())
                .find(|&k| closes(k))
                .map_or(c.len(), |k| k + 1 + hashes);
            out.push(' ');
        } else if at(i) == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
            continue;
        } else if at(i) == '\'' && (at(i + 1) == '\\' || at(i + 2) == '\'') {
            i += 1;
            while i < c.len() && c[i] != '\'' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
            continue;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Where the body of a raw string starting at `i` (`r"`, `r#"`, `br#"`…) begins, and its
/// number of `#`.
fn raw_string_at(c: &[char], i: usize) -> Option<(usize, usize)> {
    let prefix = match (c.get(i), c.get(i + 1)) {
        (Some('r'), _) => 1,
        (Some('b'), Some('r')) => 2,
        _ => return None,
    };
    let hashes = c.iter().skip(i + prefix).take_while(|&&ch| ch == '#').count();
    (c.get(i + prefix + hashes) == Some(&'"')).then_some((i + prefix + hashes + 1, hashes))
}
