// The e2b JavaScript SDK, unmodified, against dsec's E2B-compatible API (tests/test_e2b_api.py
// runs it with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set). Prints one JSON line with
// what it saw; any failure exits non-zero with the error.
import { Sandbox } from 'e2b'

const tag = process.argv[2] || 'js'
const sbx = await Sandbox.create('base', { metadata: { suite: tag }, timeoutMs: 120_000, allowInternetAccess: false })
const out = { id: sbx.sandboxId }
try {
  const info = await sbx.getInfo()
  out.state = info.state
  out.templateId = info.templateId
  out.metadata = info.metadata
  const page = await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems()
  out.listed = page.map((s) => s.sandboxId)
  await sbx.setTimeout(300_000)
} finally {
  out.killed = await sbx.kill()
}
try {
  await Sandbox.getInfo(out.id)
  out.afterKill = 'still there'
} catch (e) {
  out.afterKill = `${e.constructor.name} ${e.name} ${e.message}`
}
console.log(JSON.stringify(out))
