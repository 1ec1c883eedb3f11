// Validates an AsyncAPI document with the reference parser (@asyncapi/parser, pinned in
// package-lock.json). Prints one line per diagnostic and a summary line
// `errors=<n> warnings=<n> infos=<n> hints=<n>`; exits 1 when there is any error.
// Usage: node validate.mjs <asyncapi.yaml>
import { readFile } from 'node:fs/promises';
import { DiagnosticSeverity, Parser } from '@asyncapi/parser';

const path = process.argv[2];
if (!path) {
  console.error('usage: node validate.mjs <asyncapi.yaml>');
  process.exit(2);
}
const source = await readFile(path, 'utf8');
const { document, diagnostics } = await new Parser().parse(source, { source: path });
const names = {
  [DiagnosticSeverity.Error]: 'error',
  [DiagnosticSeverity.Warning]: 'warning',
  [DiagnosticSeverity.Information]: 'info',
  [DiagnosticSeverity.Hint]: 'hint',
};
const counts = { error: 0, warning: 0, info: 0, hint: 0 };
for (const d of diagnostics) {
  const severity = names[d.severity] ?? 'error';
  counts[severity] += 1;
  console.log(`${severity} ${d.code} at /${(d.path ?? []).join('/')}: ${d.message}`);
}
if (document === undefined && counts.error === 0) {
  counts.error = 1; // the parser produced no document: never report that as valid
  console.log('error parse: no document was produced');
}
console.log(`errors=${counts.error} warnings=${counts.warning} infos=${counts.info} hints=${counts.hint}`);
process.exit(counts.error > 0 ? 1 : 0);
