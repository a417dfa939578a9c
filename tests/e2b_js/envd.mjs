// The e2b JavaScript SDK, unmodified, against dsec's envd API (tests/test_e2b_envd.py runs it
// with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set): create, commands.run (stdout, exit
// code), files.write/read, kill. Prints one JSON line with what it saw; a failure exits non-zero.
import { Sandbox, CommandExitError } from 'e2b'

const template = process.argv[2] || 'base'
const sbx = await Sandbox.create(template, { timeoutMs: 120_000 })
const out = { id: sbx.sandboxId }
try {
  const r = await sbx.commands.run('echo js-out; echo js-err >&2')
  out.stdout = r.stdout
  out.stderr = r.stderr
  out.exitCode = r.exitCode
  try {
    await sbx.commands.run('exit 4')
    out.nonZero = 'no error'
  } catch (e) {
    out.nonZero = e instanceof CommandExitError ? e.exitCode : `${e.name}: ${e.message}`
  }
  await sbx.files.write('/tmp/js.txt', 'from js')
  out.read = await sbx.files.read('/tmp/js.txt')
} finally {
  out.killed = await sbx.kill()
}
console.log(JSON.stringify(out))
